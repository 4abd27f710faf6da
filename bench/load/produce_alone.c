/*
 * produce_alone.c
 *	  librdkafka alone: the physical limit of the relay's drain (bench/run.sh,
 *	  section 2).  Produces the messages the relay would send for a backlog of
 *	  N events, with the relay's producer settings, to the bench's broker, and
 *	  times it.  No database: what is left is librdkafka, the broker and this
 *	  machine.
 *
 *	  produce_alone BOOTSTRAP TOPIC EVENTS AGGREGATES AGGREGATE_TYPE [BATCH]
 *
 *	  Every message is what the relay sends for an event of the bench's
 *	  backlog (driver.py insert_backlog, sql payload_sql in common.py):
 *	  - key: the aggregate id, (i % AGGREGATES) + 1 as text (10,000 keys);
 *	  - value: the ~300-byte order payload as PostgreSQL's jsonb prints it
 *	    (the relay sends jsonb_out's text: keys by length, then bytes);
 *	  - headers id (a uuid as text), event_type, aggregate_type;
 *	  - timestamp: now, in ms (the relay sends created_at);
 *	  - RD_KAFKA_MSG_F_COPY, through a topic handle, as producer.c does.
 *	  Producer settings: src/config/kafka_config.c default_properties plus
 *	  what set_relay_properties adds (message.timeout.ms = the default
 *	  outbox.delivery_timeout 30000, topic.metadata.propagation.max.ms 15000);
 *	  queue.buffering.max.messages stays librdkafka's default, as the relay's.
 *
 *	  BATCH 0 (default): produce everything as fast as librdkafka takes it
 *	  (serving reports when its queue is full), then flush: the limit.
 *	  BATCH n: in batches of n, each produced and then waited for until every
 *	  delivery report is in, as the relay's cycle does (outbox.batch_size),
 *	  without the database work between batches.
 *
 *	  The clock starts at the first produce (the producer is created, the
 *	  topic's metadata known and one untimed message delivered before, so
 *	  that it has its connection and idempotent producer id, as a relay that
 *	  is already running has) and stops at the last delivery report.  Prints one JSON line:
 *	  {"events": N, "seconds": s, "events_per_s": r, "delivered": d,
 *	   "failed": f, "batch": n, "value_bytes": b, "cpu_s": c}
 *	  and exits 1 if any message failed.
 *
 *	  Built by bench/run.sh: cc -O2 -o produce_alone produce_alone.c -lrdkafka
 */
#include <librdkafka/rdkafka.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static long delivered = 0;
static long failed = 0;

static double
now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static int64_t
now_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_REALTIME, &t);
	return (int64_t) t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void
set(rd_kafka_conf_t *conf, const char *k, const char *v)
{
	char		err[512];

	if (rd_kafka_conf_set(conf, k, v, err, sizeof(err)) != RD_KAFKA_CONF_OK)
	{
		fprintf(stderr, "produce_alone: %s: %s\n", k, err);
		exit(1);
	}
}

static void
dr_cb(rd_kafka_t *rk, const rd_kafka_message_t *m, void *opaque)
{
	if (m->err)
	{
		if (failed++ < 5)
			fprintf(stderr, "produce_alone: delivery failed: %s\n",
					rd_kafka_err2str(m->err));
	}
	else
		delivered++;
}

/* xorshift64*: the uuids only have to look like uuids, cheaply */
static uint64_t rng = 0x9E3779B97F4A7C15ULL;

static uint64_t
next_rand(void)
{
	rng ^= rng >> 12;
	rng ^= rng << 25;
	rng ^= rng >> 27;
	return rng * 0x2545F4914F6CDD1DULL;
}

/* a version-4 uuid as the relay formats it (36 characters) */
static void
uuid_text(char *out)
{
	static const char hex[] = "0123456789abcdef";
	unsigned char b[16];
	uint64_t	a = next_rand(),
				c = next_rand();
	int			i,
				o = 0;

	memcpy(b, &a, 8);
	memcpy(b + 8, &c, 8);
	b[6] = (b[6] & 0x0f) | 0x40;
	b[8] = (b[8] & 0x3f) | 0x80;
	for (i = 0; i < 16; i++)
	{
		if (i == 4 || i == 6 || i == 8 || i == 10)
			out[o++] = '-';
		out[o++] = hex[b[i] >> 4];
		out[o++] = hex[b[i] & 15];
	}
	out[o] = '\0';
}

/* the bench's payload for event g (1-based), as jsonb_out prints it */
static int
payload(char *buf, size_t size, long g, long aggregates)
{
	return snprintf(buf, size,
					"{\"note\": \"%s\", \"lines\": [{\"qty\": 2, \"sku\": \"SKU-%06ld\", \"price\": 19.99}, "
					"{\"qty\": 1, \"sku\": \"SKU-000042\", \"price\": 83.47}], \"total\": 123.45, "
					"\"status\": \"created\", \"currency\": \"EUR\", \"customer\": \"customer-%ld\", "
					"\"order_id\": %ld}",
					"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
					g % 1000000, g % aggregates + 1, g);
}

static void
produce_one(rd_kafka_t *rk, rd_kafka_topic_t *rkt, long g, long aggregates,
			const char *aggregate_type, long *value_bytes)
{
	char		key[24];
	char		value[512];
	char		id[40];
	int			klen,
				vlen;
	rd_kafka_headers_t *h;
	rd_kafka_resp_err_t err;

	klen = snprintf(key, sizeof(key), "%ld", g % aggregates + 1);
	vlen = payload(value, sizeof(value), g, aggregates);
	*value_bytes += vlen;
	uuid_text(id);
	for (;;)
	{
		h = rd_kafka_headers_new(3);
		rd_kafka_header_add(h, "id", -1, id, 36);
		rd_kafka_header_add(h, "event_type", -1, "order.created", 13);
		rd_kafka_header_add(h, "aggregate_type", -1, aggregate_type, strlen(aggregate_type));
		err = rd_kafka_producev(rk,
								RD_KAFKA_V_RKT(rkt),
								RD_KAFKA_V_KEY(key, klen),
								RD_KAFKA_V_VALUE(value, vlen),
								RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
								RD_KAFKA_V_HEADERS(h),
								RD_KAFKA_V_TIMESTAMP(now_ms()),
								RD_KAFKA_V_END);
		if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
			return;
		rd_kafka_headers_destroy(h);
		if (err != RD_KAFKA_RESP_ERR__QUEUE_FULL)
		{
			fprintf(stderr, "produce_alone: produce: %s\n", rd_kafka_err2str(err));
			exit(1);
		}
		/* as the relay on _QUEUE_FULL: serve reports, then try again */
		rd_kafka_poll(rk, 1);
	}
}

int
main(int argc, char **argv)
{
	rd_kafka_conf_t *conf;
	rd_kafka_t *rk;
	rd_kafka_topic_t *rkt;
	const struct rd_kafka_metadata *md;
	char		err[512];
	long		events,
				aggregates,
				batch = 0,
				g,
				value_bytes = 0;
	const char *aggregate_type;
	double		t0,
				t1;
	struct rusage ru;

	if (argc < 6)
	{
		fprintf(stderr, "usage: produce_alone BOOTSTRAP TOPIC EVENTS AGGREGATES AGGREGATE_TYPE [BATCH]\n");
		return 2;
	}
	events = atol(argv[3]);
	aggregates = atol(argv[4]);
	aggregate_type = argv[5];
	if (argc > 6)
		batch = atol(argv[6]);

	conf = rd_kafka_conf_new();
	set(conf, "bootstrap.servers", argv[1]);
	/* set_relay_properties: the default outbox.delivery_timeout, and half of it */
	set(conf, "message.timeout.ms", "30000");
	set(conf, "topic.metadata.propagation.max.ms", "15000");
	/* default_properties of src/config/kafka_config.c */
	set(conf, "enable.idempotence", "true");
	set(conf, "acks", "all");
	set(conf, "partitioner", "murmur2_random");
	set(conf, "linger.ms", "1");
	set(conf, "message.max.bytes", "1048588");
	set(conf, "enable.gapless.guarantee", "true");
	set(conf, "queue.buffering.max.kbytes", "65536");
	set(conf, "client.id", "outbox-bench-produce-alone");
	set(conf, "socket.keepalive.enable", "true");
	set(conf, "socket.nagle.disable", "true");
	rd_kafka_conf_set_dr_msg_cb(conf, dr_cb);

	rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
	if (rk == NULL)
	{
		fprintf(stderr, "produce_alone: %s\n", err);
		return 1;
	}
	rkt = rd_kafka_topic_new(rk, argv[2], NULL);
	/* the topic's metadata before the clock starts, as a running relay has it */
	if (rd_kafka_metadata(rk, 0, rkt, &md, 30000) != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		fprintf(stderr, "produce_alone: no metadata for %s\n", argv[2]);
		return 1;
	}
	rd_kafka_metadata_destroy(md);
	/*
	 * One message first, not timed: a running relay has its idempotent
	 * producer id and its connection; so must this producer.  The topic
	 * holds EVENTS + 1 messages.
	 */
	produce_one(rk, rkt, 0, aggregates, aggregate_type, &value_bytes);
	if (rd_kafka_flush(rk, 30000) != RD_KAFKA_RESP_ERR_NO_ERROR || delivered != 1)
	{
		fprintf(stderr, "produce_alone: the warm-up message was not delivered\n");
		return 1;
	}
	delivered = 0;
	value_bytes = 0;

	t0 = now_s();
	for (g = 1; g <= events; g++)
	{
		produce_one(rk, rkt, g, aggregates, aggregate_type, &value_bytes);
		if (batch > 0 && (g % batch == 0 || g == events))
		{
			/* the relay's cycle: every report of the batch before the next */
			while (delivered + failed < g)
				rd_kafka_poll(rk, 10);
		}
		else if ((g & 1023) == 0)
			rd_kafka_poll(rk, 0);
	}
	while (delivered + failed < events)
		rd_kafka_poll(rk, 10);
	t1 = now_s();

	getrusage(RUSAGE_SELF, &ru);
	printf("{\"events\": %ld, \"seconds\": %.3f, \"events_per_s\": %.1f, \"delivered\": %ld, "
		   "\"failed\": %ld, \"batch\": %ld, \"value_bytes\": %.1f, \"cpu_s\": %.2f}\n",
		   events, t1 - t0, events / (t1 - t0), delivered, failed, batch,
		   (double) value_bytes / events,
		   ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
		   ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6);
	rd_kafka_topic_destroy(rkt);
	rd_kafka_destroy(rk);
	return failed > 0 ? 1 : 0;
}

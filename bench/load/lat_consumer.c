/*
 * lat_consumer.c
 *	  Low-overhead latency consumer for bench/run.sh, section 3: the C twin of
 *	  consumer.py (same arguments, same CSV), so that the commit -> consumer
 *	  figure is not bounded by a Python process on a 2-core machine.
 *
 *	  lat_consumer BOOTSTRAP TOPIC PARTITIONS OUT_CSV STOP_FILE [GRACE_S]
 *
 *	  Assigns all partitions from the beginning, prints READY once the fetchers
 *	  run, and records per message: the "id" header, the receive time
 *	  (CLOCK_REALTIME, the clock of the load generator's time.time()), the
 *	  partition and the message timestamp (LogAppendTime on the bench topics).
 *	  Stops when STOP_FILE exists (it holds the number of committed events) and
 *	  that many messages arrived, or GRACE_S seconds after it appeared.
 *	  Prints "RECEIVED <messages> <messages>" (ids are deduplicated by the
 *	  driver; this process only counts).
 *
 *	  Built by bench/run.sh: cc -O2 -o lat_consumer lat_consumer.c -lrdkafka
 */
#include <librdkafka/rdkafka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct Rec
{
	char		id[40];
	double		recv;
	int32_t		partition;
	int64_t		ts;
	int			tstype;
} Rec;

static double
now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_REALTIME, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void
set(rd_kafka_conf_t *conf, const char *k, const char *v)
{
	char		err[512];

	if (rd_kafka_conf_set(conf, k, v, err, sizeof(err)) != RD_KAFKA_CONF_OK)
	{
		fprintf(stderr, "lat_consumer: %s: %s\n", k, err);
		exit(1);
	}
}

int
main(int argc, char **argv)
{
	rd_kafka_conf_t *conf;
	rd_kafka_t *rk;
	rd_kafka_topic_partition_list_t *parts;
	char		err[512];
	int			nparts;
	double		grace = 120.0;
	double		stop_seen = 0;
	long		expected = -1;
	size_t		n = 0,
				cap = 1 << 16;
	Rec		   *recs;
	FILE	   *f;

	if (argc < 6)
	{
		fprintf(stderr, "usage: lat_consumer BOOTSTRAP TOPIC PARTITIONS OUT_CSV STOP_FILE [GRACE_S]\n");
		return 2;
	}
	nparts = atoi(argv[3]);
	if (argc > 6)
		grace = atof(argv[6]);
	recs = malloc(cap * sizeof(Rec));

	conf = rd_kafka_conf_new();
	set(conf, "bootstrap.servers", argv[1]);
	set(conf, "group.id", "bench-latency-c");
	set(conf, "enable.auto.commit", "false");
	/* the same fetch settings as consumer.py */
	set(conf, "fetch.wait.max.ms", "5");
	set(conf, "fetch.min.bytes", "1");
	set(conf, "fetch.error.backoff.ms", "10");
	rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof(err));
	if (rk == NULL)
	{
		fprintf(stderr, "lat_consumer: %s\n", err);
		return 1;
	}
	parts = rd_kafka_topic_partition_list_new(nparts);
	for (int p = 0; p < nparts; p++)
		rd_kafka_topic_partition_list_add(parts, argv[2], p)->offset = RD_KAFKA_OFFSET_BEGINNING;
	if (rd_kafka_assign(rk, parts) != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		fprintf(stderr, "lat_consumer: assign failed\n");
		return 1;
	}
	rd_kafka_topic_partition_list_destroy(parts);
	for (int i = 0; i < 5; i++)
	{
		rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 200);

		if (m)
			rd_kafka_message_destroy(m);
	}
	printf("READY\n");
	fflush(stdout);

	for (;;)
	{
		/* one message per call: no batch window between arrival and recv */
		rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 50);

		if (m != NULL)
		{
			double		t = now_s();

			if (m->err == RD_KAFKA_RESP_ERR_NO_ERROR)
			{
				rd_kafka_headers_t *hdrs;
				const void *val = NULL;
				size_t		len = 0;
				rd_kafka_timestamp_type_t tstype;
				Rec		   *r;

				if (n == cap)
				{
					cap *= 2;
					recs = realloc(recs, cap * sizeof(Rec));
				}
				r = &recs[n++];
				r->recv = t;
				r->partition = m->partition;
				r->ts = rd_kafka_message_timestamp(m, &tstype);
				r->tstype = (int) tstype;
				r->id[0] = '\0';
				if (rd_kafka_message_headers(m, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR &&
					rd_kafka_header_get_last(hdrs, "id", &val, &len) == RD_KAFKA_RESP_ERR_NO_ERROR &&
					val != NULL)
				{
					if (len >= sizeof(r->id))
						len = sizeof(r->id) - 1;
					memcpy(r->id, val, len);
					r->id[len] = '\0';
				}
			}
			rd_kafka_message_destroy(m);
		}
		if (expected < 0 && access(argv[5], R_OK) == 0)
		{
			FILE	   *sf = fopen(argv[5], "r");

			if (sf != NULL && fscanf(sf, "%ld", &expected) == 1)
				stop_seen = now_s();
			else
				expected = -1;
			if (sf != NULL)
				fclose(sf);
		}
		if (expected >= 0 && ((long) n >= expected || now_s() - stop_seen > grace))
			break;
	}
	rd_kafka_consumer_close(rk);
	rd_kafka_destroy(rk);

	f = fopen(argv[4], "w");
	if (f == NULL)
	{
		perror(argv[4]);
		return 1;
	}
	fprintf(f, "event_id,recv_time,partition,kafka_ts_ms,kafka_ts_type\n");
	for (size_t i = 0; i < n; i++)
		fprintf(f, "%s,%.6f,%d,%lld,%d\n", recs[i].id, recs[i].recv, recs[i].partition,
				(long long) recs[i].ts, recs[i].tstype);
	fclose(f);
	printf("RECEIVED %zu %zu\n", n, n);
	return 0;
}

/*-------------------------------------------------------------------------
 *
 * progress_log.c
 *	  Read back the relay's last committed progress record from the
 *	  progress topic (outbox.delivery = exactly_once).
 *
 * A read of the topic's end can be stale: Materialize saw a restarted sink
 * read an older progress value than the broker had acknowledged.  So, as
 * Materialize does since, the relay first commits a sentinel of its own (a
 * random nonce under the key "<transactional.id>.sentinel", a key of its
 * own so that compaction never drops the real record for it), learns its
 * offset from the delivery report, and then reads the partition with
 * isolation.level = read_committed up to that offset.  The last record
 * under the key "<transactional.id>" before it is the last progress the
 * relay committed: nothing of this transactional.id can still be open,
 * since rd_kafka_init_transactions() ran before.
 *
 * The read starts a little before the sentinel and goes back further (ten
 * times as far each time) only while the relay's key was not found: the
 * topic is shared by every relay of the Kafka cluster.  On its way it keeps
 * the last record of each other relay of the database (exactly_once.c says
 * why).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "exactly_once/progress_log.h"
#include "config/guc.h"
#include "config/kafka_config.h"
#include "exactly_once/txn.h"
#include "kafka/broker_call.h"
#include "kafka/producer.h"

#include "miscadmin.h"
#include "storage/procsignal.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#define FIRST_WINDOW	1000	/* offsets read before the sentinel at first */

static bool write_sentinel(OutboxProducer *producer, const char *topic,
						   const char *key, const char *nonce, int timeout_ms,
						   int64 *offset, char **error);
static rd_kafka_t *new_consumer(char **error);
static bool read_range(rd_kafka_t *consumer, const char *topic, int64 start,
					   int64 end, int timeout_ms,
					   OutboxProgressRecords *records, char **error);
static int	relay_of_key(const OutboxProgressRecords *records, const char *key,
						 size_t key_len);
static void ignore_log(const rd_kafka_t *rk, int level, const char *fac,
					   const char *buf);

/*
 * outbox_progress_read_back
 *		Commit a sentinel to topic (under key, this relay's, with
 *		".sentinel") and put into records the last progress record committed
 *		before it by each relay of the database found in the offsets read
 *		(values palloc'd, NUL-terminated): always this relay's own
 *		(records->self) if it ever committed one.
 *		Returns false with *error (palloc'd) when Kafka did not answer
 *		within timeout_ms (ms) or the producer failed; raises no ERROR but
 *		stops waiting on SIGTERM (CHECK_FOR_INTERRUPTS).
 */
bool
outbox_progress_read_back(OutboxProducer *producer, const char *topic,
						  const char *key, int timeout_ms,
						  OutboxProgressRecords *records, char **error)
{
	char		nonce_bytes[16];
	char		nonce[33];
	char	   *sentinel_key = psprintf("%s.sentinel", key);
	int64		sentinel;
	int64		low;
	int64		high;
	int64		start;
	int64		window = FIRST_WINDOW;
	rd_kafka_t *consumer;
	rd_kafka_resp_err_t err;
	bool		ok = true;

	if (!pg_strong_random(nonce_bytes, sizeof(nonce_bytes)))
		memset(nonce_bytes, 0, sizeof(nonce_bytes));
	nonce[hex_encode(nonce_bytes, sizeof(nonce_bytes), nonce)] = '\0';
	if (!write_sentinel(producer, topic, sentinel_key, nonce, timeout_ms,
						&sentinel, error))
		return false;

	consumer = new_consumer(error);
	if (consumer == NULL)
		return false;
	err = outbox_kafka_watermarks(consumer, topic, 0, &low, &high, timeout_ms);
	if (err != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		*error = psprintf("could not read the offsets of the progress topic \"%s\": %s",
						  topic, rd_kafka_err2str(err));
		rd_kafka_destroy_flags(consumer, RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE);
		return false;
	}
	for (;;)
	{
		start = Max(low, sentinel - window);
		ok = read_range(consumer, topic, start, sentinel, timeout_ms,
						records, error);
		if (!ok || records->records[records->self] != NULL || start <= low)
			break;
		window *= 10;
	}
	/*
	 * The consumer has a group.id but never joins the group (assign()):
	 * plain rd_kafka_destroy() would still run rd_kafka_consumer_close(),
	 * a blocking exchange with the group's coordinator, for nothing.
	 */
	rd_kafka_destroy_flags(consumer, RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE);
	return ok;
}

/*
 * Commit one sentinel record (key, nonce) in a transaction of its own and
 * put its offset into *offset.
 */
static bool
write_sentinel(OutboxProducer *producer, const char *topic, const char *key,
			   const char *nonce, int timeout_ms, int64 *offset, char **error)
{
	OutboxMessage msg;

	memset(&msg, 0, sizeof(msg));
	msg.topic = topic;
	msg.key = key;
	msg.key_len = strlen(key);
	msg.value = nonce;
	msg.value_len = strlen(nonce);
	msg.timestamp_ms = 0;

	if (outbox_txn_begin(producer, error) != OUTBOX_TXN_OK)
		return false;
	outbox_producer_begin_batch(producer, 1);
	if (outbox_producer_send(producer, 0, &msg) != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		*error = psprintf("could not produce the sentinel to the progress topic \"%s\"", topic);
		(void) outbox_txn_abort(producer, timeout_ms, error);
		return false;
	}
	if (outbox_txn_commit(producer, timeout_ms, error) != OUTBOX_TXN_OK)
	{
		if (!producer->fatal)
			(void) outbox_txn_abort(producer, timeout_ms, error);
		return false;
	}
	outbox_producer_serve(producer);
	if (!producer->deliveries[0].reported ||
		producer->deliveries[0].err != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		*error = psprintf("the sentinel written to the progress topic \"%s\" got no delivery report", topic);
		return false;
	}
	*offset = producer->deliveries[0].offset;
	return true;
}

/*
 * A consumer with the relay's connection settings (outbox.bootstrap_servers
 * and outbox.kafka_properties: security, SASL) that reads only committed
 * records.  The producer's own properties in that configuration are
 * ignored by a consumer; librdkafka's notes about them are dropped.
 */
static rd_kafka_t *
new_consumer(char **error)
{
	rd_kafka_conf_t *conf;
	rd_kafka_t *consumer;
	char		errstr[512];

	conf = outbox_kafka_conf_new(outbox_bootstrap_servers,
								 outbox_delivery_timeout,
								 outbox_kafka_properties, error);
	if (conf == NULL)
		return NULL;
	rd_kafka_conf_set_log_cb(conf, ignore_log);
	if (rd_kafka_conf_set(conf, "isolation.level", "read_committed", errstr,
						  sizeof(errstr)) != RD_KAFKA_CONF_OK ||
		rd_kafka_conf_set(conf, "enable.auto.commit", "false", errstr,
						  sizeof(errstr)) != RD_KAFKA_CONF_OK ||
		rd_kafka_conf_set(conf, "enable.partition.eof", "false", errstr,
						  sizeof(errstr)) != RD_KAFKA_CONF_OK ||
		rd_kafka_conf_set(conf, "client.id", "outbox-relay-progress", errstr,
						  sizeof(errstr)) != RD_KAFKA_CONF_OK ||
	/* rd_kafka_consumer_poll() needs a group; assign() never joins it */
		rd_kafka_conf_set(conf, "group.id", "outbox-relay-progress", errstr,
						  sizeof(errstr)) != RD_KAFKA_CONF_OK)
	{
		rd_kafka_conf_destroy(conf);
		*error = psprintf("could not configure the progress reader: %s", errstr);
		return NULL;
	}
	consumer = rd_kafka_new(RD_KAFKA_CONSUMER, conf, errstr, sizeof(errstr));
	if (consumer == NULL)
	{
		rd_kafka_conf_destroy(conf);
		*error = psprintf("could not create the progress reader: %s", errstr);
	}
	return consumer;
}

/*
 * Read offsets start .. end (the sentinel) of partition 0 and keep the
 * value of the last record of each relay of the database in records.
 */
static bool
read_range(rd_kafka_t *consumer, const char *topic, int64 start, int64 end,
		   int timeout_ms, OutboxProgressRecords *records, char **error)
{
	rd_kafka_topic_partition_list_t *parts = rd_kafka_topic_partition_list_new(1);
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout_ms);
	bool		done = false;

	rd_kafka_topic_partition_list_add(parts, topic, 0)->offset = start;
	rd_kafka_assign(consumer, parts);
	rd_kafka_topic_partition_list_destroy(parts);

	while (!done)
	{
		rd_kafka_message_t *m = rd_kafka_consumer_poll(consumer, 100);

		if (m == NULL)
		{
			if (GetCurrentTimestamp() >= deadline)
			{
				*error = psprintf("reading the progress topic \"%s\" back to offset " INT64_FORMAT " timed out",
								  topic, end);
				break;
			}
			if (ProcSignalBarrierPending)
				ProcessProcSignalBarrier();
			CHECK_FOR_INTERRUPTS();
			continue;
		}
		if (m->err == RD_KAFKA_RESP_ERR_NO_ERROR)
		{
			int			relay = -1;

			if (m->offset < end && m->key != NULL)
				relay = relay_of_key(records, m->key, m->key_len);
			if (relay >= 0)
			{
				if (records->records[relay] != NULL)
					pfree(records->records[relay]);
				records->records[relay] = pnstrdup(m->payload ? (const char *) m->payload : "",
												   m->len);
			}
			done = m->offset >= end;
		}
		else if (m->err != RD_KAFKA_RESP_ERR__PARTITION_EOF)
		{
			*error = psprintf("could not read the progress topic \"%s\": %s",
							  topic, rd_kafka_message_errstr(m));
			rd_kafka_message_destroy(m);
			break;
		}
		rd_kafka_message_destroy(m);
	}
	rd_kafka_assign(consumer, NULL);
	return done;
}

/*
 * Which relay of the database writes under key (0 for database_key, n - 1
 * for database_key "-w<n>"), or -1 for a key of no relay of it.
 */
static int
relay_of_key(const OutboxProgressRecords *records, const char *key,
			 size_t key_len)
{
	size_t		base_len = strlen(records->database_key);
	char		suffix[8];
	int			n;
	char		end;

	if (key_len < base_len || memcmp(key, records->database_key, base_len) != 0)
		return -1;
	if (key_len == base_len)
		return 0;
	if (key_len - base_len >= sizeof(suffix))
		return -1;
	memcpy(suffix, key + base_len, key_len - base_len);
	suffix[key_len - base_len] = '\0';
	if (sscanf(suffix, "-w%d%c", &n, &end) != 1 ||
		n < 2 || n > OUTBOX_MAX_WORKERS_PER_DATABASE)
		return -1;
	return n - 1;
}

/* librdkafka's notes about producer properties on a consumer: not ours */
static void
ignore_log(const rd_kafka_t *rk, int level, const char *fac, const char *buf)
{
}

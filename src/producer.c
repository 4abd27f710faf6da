/*-------------------------------------------------------------------------
 *
 * producer.c
 *	  The relay's Kafka producer, built on librdkafka.
 *
 * Rules this file keeps (see ../shared/reference/kafka-notes.md):
 *	- The producer is created in the relay worker, never in the postmaster:
 *	  librdkafka's threads do not survive fork().
 *	- Delivery reports, errors and librdkafka's own log lines are all routed
 *	  to the main queue and served by rd_kafka_poll() on the worker's thread.
 *	  The callbacks below only copy data into memory allocated beforehand:
 *	  no palloc, no ereport, no CHECK_FOR_INTERRUPTS, because a longjmp out
 *	  of rd_kafka_poll() would lose the delivery reports still queued.
 *	- librdkafka writes a byte to a pipe whenever events are queued, and the
 *	  worker waits on that pipe together with its latch, so it never blocks
 *	  inside librdkafka and stays responsive to SIGTERM, SIGHUP and
 *	  procsignal barriers.
 *	- Delivery guarantees are not negotiable: acks=all and the idempotent
 *	  producer keep each partition in order through retries, and the murmur2
 *	  partitioner puts a key on the partition a Java client would choose.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "kafka_config.h"
#include "producer.h"

#include <fcntl.h>
#include <unistd.h>

#include "miscadmin.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* topics whose handles we keep; past this, each message looks its topic up */
#define MAX_CACHED_TOPICS	10000

/* how long the first message to a topic may wait for its metadata */
#define TOPIC_METADATA_TIMEOUT_MS	500

/* how long a topic error from the metadata is trusted before asking again */
#define TOPIC_ERROR_RECHECK_MS	1000

/* how long a new topic may take to be auto-created by the broker */
#define TOPIC_CREATE_WAIT_MS	1500
#define TOPIC_CREATE_POLL_MS	50

typedef struct TopicEntry
{
	char		name[OUTBOX_TOPIC_MAX_LEN + 1];	/* hash key */
	rd_kafka_topic_t *rkt;
	rd_kafka_resp_err_t error;	/* topic refused by the cluster, or 0 */
	TimestampTz checked_at;		/* when error was last looked up */
} TopicEntry;

StaticAssertDecl(SIZEOF_VOID_P >= 8,
				 "delivery opaques pack a generation and an index into a pointer");

static void dr_msg_cb(rd_kafka_t *rk, const rd_kafka_message_t *msg,
					  void *opaque);
static void error_cb(rd_kafka_t *rk, int err, const char *reason,
					 void *opaque);
static void log_cb(const rd_kafka_t *rk, int level, const char *fac,
				   const char *buf);
static bool set_property(rd_kafka_conf_t *conf, const char *key,
						 const char *value, char **error);

/*
 * Defaults the relay sets before the user's outbox.kafka_properties.
 * acks and idempotence are fixed (kafka_config.c refuses to override them);
 * the rest are tuned for a relay that sends batches and waits for their
 * reports.
 */
static const char *const default_properties[][2] = {
	{"enable.idempotence", "true"},
	{"acks", "all"},
	/* same key -> partition mapping as the Java client and Debezium */
	{"partitioner", "murmur2_random"},
	/* a claimed batch is produced at once; do not wait to fill batches */
	{"linger.ms", "1"},
	/* the broker's default message.max.bytes (1 MiB + 12), not 1 MB */
	{"message.max.bytes", "1048588"},

	/*
	 * When the broker refuses a message for good (too large for the topic,
	 * say), the idempotent producer would go on with the partition's later
	 * messages, so a later event of the same aggregate could overtake the
	 * refused one.  With this, librdkafka stops instead (a fatal error):
	 * the relay records the refusal, rebuilds the producer, and the held
	 * back events wait behind the refused one.  (A later batch may already
	 * be on the wire when it stops, so the relay also keeps a large event's
	 * successors out of its batch: see BARRIER_BYTES in message.c.)
	 */
	{"enable.gapless.guarantee", "true"},

	/* bound the memory librdkafka may queue (default would be 1 GB) */
	{"queue.buffering.max.kbytes", "65536"},
	{"client.id", "outbox-relay"},
	/* reports, errors and logs reach us only through rd_kafka_poll() */
	{"log.queue", "true"},
	{"socket.keepalive.enable", "true"},
	/* small produce requests go out at once, not after the peer's ACK */
	{"socket.nagle.disable", "true"},
	/* never run sasl.kerberos.kinit.cmd (a shell command): see kafka_config.c */
	{"sasl.kerberos.min.time.before.relogin", "0"},
	{NULL, NULL}
};

/*
 * outbox_producer_create
 *		Build a producer from the current outbox.* settings.
 *
 * Returns NULL with *error set (palloc'd, free of property values, which may
 * be secrets) when a property is unknown or invalid or librdkafka refuses
 * the configuration.  The producer lives in TopMemoryContext until
 * outbox_producer_destroy().  Never call this in the postmaster.
 */
OutboxProducer *
outbox_producer_create(char **error)
{
	OutboxProducer *producer;
	rd_kafka_conf_t *conf;
	rd_kafka_queue_t *mainq;
	OutboxKafkaProperty *props;
	int			nprops;
	char		errstr[512];
	char		timeout[32];
	char		propagation[32];
	int			i;

	if (!outbox_parse_kafka_properties(outbox_kafka_properties, &props,
									   &nprops, error))
	{
		*error = psprintf("outbox.kafka_properties: %s", *error);
		return NULL;
	}

	conf = rd_kafka_conf_new();
	snprintf(timeout, sizeof(timeout), "%d", outbox_delivery_timeout);

	/*
	 * A topic that does not appear must be reported as unknown (permanent)
	 * before its messages time out (transient), so wait at most half the
	 * delivery timeout for it to show up.
	 */
	snprintf(propagation, sizeof(propagation), "%d",
			 Min(30000, outbox_delivery_timeout / 2));
	if (!set_property(conf, "bootstrap.servers", outbox_bootstrap_servers, error) ||
		!set_property(conf, "message.timeout.ms", timeout, error) ||
		!set_property(conf, "topic.metadata.propagation.max.ms", propagation, error))
	{
		rd_kafka_conf_destroy(conf);
		return NULL;
	}
	for (i = 0; default_properties[i][0] != NULL; i++)
	{
		if (!set_property(conf, default_properties[i][0],
						  default_properties[i][1], error))
		{
			rd_kafka_conf_destroy(conf);
			return NULL;
		}
	}
	for (i = 0; i < nprops; i++)
	{
		if (!set_property(conf, props[i].key, props[i].value, error))
		{
			*error = psprintf("outbox.kafka_properties: %s", *error);
			rd_kafka_conf_destroy(conf);
			return NULL;
		}
	}

	producer = MemoryContextAllocZero(TopMemoryContext, sizeof(OutboxProducer));
	producer->wakeup_fd[0] = producer->wakeup_fd[1] = -1;
	rd_kafka_conf_set_opaque(conf, producer);
	rd_kafka_conf_set_dr_msg_cb(conf, dr_msg_cb);
	rd_kafka_conf_set_error_cb(conf, error_cb);
	rd_kafka_conf_set_log_cb(conf, log_cb);

	/* on success rd_kafka_new() owns conf */
	producer->rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, sizeof(errstr));
	if (producer->rk == NULL)
	{
		rd_kafka_conf_destroy(conf);
		pfree(producer);
		*error = psprintf("could not create the Kafka producer: %s", errstr);
		return NULL;
	}
	rd_kafka_set_log_queue(producer->rk, NULL);

	if (pipe(producer->wakeup_fd) != 0 ||
		fcntl(producer->wakeup_fd[0], F_SETFL, O_NONBLOCK) != 0 ||
		fcntl(producer->wakeup_fd[1], F_SETFL, O_NONBLOCK) != 0 ||
		fcntl(producer->wakeup_fd[0], F_SETFD, FD_CLOEXEC) != 0 ||
		fcntl(producer->wakeup_fd[1], F_SETFD, FD_CLOEXEC) != 0)
	{
		*error = psprintf("could not create the producer's wake-up pipe: %m");
		outbox_producer_destroy(producer);
		return NULL;
	}
	mainq = rd_kafka_queue_get_main(producer->rk);
	rd_kafka_queue_io_event_enable(mainq, producer->wakeup_fd[1], "1", 1);
	rd_kafka_queue_destroy(mainq);

	{
		HASHCTL		ctl;

		ctl.keysize = OUTBOX_TOPIC_MAX_LEN + 1;
		ctl.entrysize = sizeof(TopicEntry);
		ctl.hcxt = TopMemoryContext;
		producer->topics = hash_create("outbox relay topics", 64, &ctl,
									   HASH_ELEM | HASH_STRINGS | HASH_CONTEXT);
	}

	producer->bootstrap_servers = MemoryContextStrdup(TopMemoryContext,
													  outbox_bootstrap_servers);
	producer->kafka_properties = MemoryContextStrdup(TopMemoryContext,
													 outbox_kafka_properties);
	producer->delivery_timeout = outbox_delivery_timeout;
	return producer;
}

static bool
set_property(rd_kafka_conf_t *conf, const char *key, const char *value,
			 char **error)
{
	char		errstr[512];
	rd_kafka_conf_res_t res;

	res = rd_kafka_conf_set(conf, key, value, errstr, sizeof(errstr));
	if (res == RD_KAFKA_CONF_OK)
		return true;
	if (res == RD_KAFKA_CONF_UNKNOWN)
		*error = psprintf("unknown librdkafka property \"%s\"", key);
	else if (outbox_kafka_property_is_secret(key))
		*error = psprintf("invalid value for librdkafka property \"%s\"", key);
	else
		*error = psprintf("invalid value for librdkafka property \"%s\": %s",
						  key, errstr);
	return false;
}

/*
 * outbox_producer_destroy
 *		Drop everything queued or in flight and free the producer.
 *
 * Purging first makes rd_kafka_destroy() return at once even when no broker
 * is reachable, so a fast shutdown stays fast.  Events not yet acknowledged
 * are still unpublished in the table and go out again later.
 */
void
outbox_producer_destroy(OutboxProducer *producer)
{
	if (producer == NULL)
		return;
	if (producer->rk != NULL)
	{
		producer->generation++;
		rd_kafka_purge(producer->rk,
					   RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
		rd_kafka_poll(producer->rk, 0);
		if (producer->topics != NULL)
		{
			HASH_SEQ_STATUS seq;
			TopicEntry *entry;

			hash_seq_init(&seq, producer->topics);
			while ((entry = hash_seq_search(&seq)) != NULL)
				rd_kafka_topic_destroy(entry->rkt);
		}
		rd_kafka_destroy(producer->rk);
		producer->rk = NULL;
	}
	if (producer->topics != NULL)
		hash_destroy(producer->topics);
	if (producer->wakeup_fd[0] >= 0)
		close(producer->wakeup_fd[0]);
	if (producer->wakeup_fd[1] >= 0)
		close(producer->wakeup_fd[1]);
	if (producer->deliveries)
		pfree(producer->deliveries);
	if (producer->bootstrap_servers)
		pfree(producer->bootstrap_servers);
	if (producer->kafka_properties)
		pfree(producer->kafka_properties);
	pfree(producer);
}

/*
 * outbox_producer_settings_changed
 *		True if a reload changed a setting the producer was built with.
 */
bool
outbox_producer_settings_changed(OutboxProducer *producer)
{
	return strcmp(producer->bootstrap_servers, outbox_bootstrap_servers) != 0 ||
		strcmp(producer->kafka_properties, outbox_kafka_properties) != 0 ||
		producer->delivery_timeout != outbox_delivery_timeout;
}

/*
 * outbox_producer_begin_batch
 *		Start a new batch of up to capacity messages.
 *
 * Reports that still arrive for an earlier (aborted) batch carry an older
 * generation and are ignored.
 */
void
outbox_producer_begin_batch(OutboxProducer *producer, int capacity)
{
	if (producer->capacity < capacity)
	{
		if (producer->deliveries)
			pfree(producer->deliveries);
		producer->deliveries = MemoryContextAlloc(TopMemoryContext,
												  sizeof(OutboxDelivery) * capacity);
		producer->capacity = capacity;
	}
	memset(producer->deliveries, 0, sizeof(OutboxDelivery) * producer->capacity);
	producer->generation++;
	producer->outstanding = 0;
}

/*
 * Ask the cluster about one topic, waiting at most TOPIC_METADATA_TIMEOUT_MS,
 * and remember whether it refuses the topic.  Errors of the request itself
 * (no broker answered) say nothing about the topic and are not kept.
 */
static void
check_topic(OutboxProducer *producer, TopicEntry *entry)
{
	const struct rd_kafka_metadata *md = NULL;

	entry->checked_at = GetCurrentTimestamp();
	if (producer->all_brokers_down)
		return;					/* not worth a wait when no broker answers */
	if (rd_kafka_metadata(producer->rk, 0, entry->rkt, &md,
						  TOPIC_METADATA_TIMEOUT_MS) != RD_KAFKA_RESP_ERR_NO_ERROR)
		return;
	entry->error = RD_KAFKA_RESP_ERR_NO_ERROR;
	if (md->topic_cnt == 1)
	{
		switch (md->topics[0].err)
		{
			case RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED:
			case RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION:
			case RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART:
				entry->error = md->topics[0].err;
				break;
			default:
				break;
		}
	}
	rd_kafka_metadata_destroy(md);
}

/*
 * A broker with auto.create.topics.enable answers the first metadata
 * request for a new topic with UNKNOWN_TOPIC_OR_PART and creates it
 * meanwhile: ask again for a moment before taking the topic as refused, so
 * that the first event to a new topic does not count as a failed attempt.
 * Done once per topic and producer; a topic that stays unknown costs
 * TOPIC_CREATE_WAIT_MS once.
 */
static void
wait_for_topic_creation(OutboxProducer *producer, TopicEntry *entry)
{
	int			waited = 0;

	while (entry->error == RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART &&
		   waited < TOPIC_CREATE_WAIT_MS)
	{
		/* interrupts are held during a batch (batch.c): look for SIGTERM */
		if (ProcDiePending)
			return;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(TOPIC_CREATE_POLL_MS * 1000L);
		waited += TOPIC_CREATE_POLL_MS;
		check_topic(producer, entry);
	}
}

/*
 * The handle of a topic, created on first use, and whether the cluster
 * refuses it (*error).
 *
 * librdkafka looks up unknown topics only about once a second, so the first
 * message to each topic would wait up to a second; asking for the topic's
 * metadata right away makes that a round trip instead.  The same answer
 * tells whether the topic is refused (not authorized, does not exist and
 * will not be created): librdkafka would only let such messages time out,
 * which looks like a broker outage; the relay fails them at once instead,
 * as a permanent error.  A refusal is looked up again after
 * TOPIC_ERROR_RECHECK_MS, so a fixed ACL or a created topic is noticed.
 *
 * Returns NULL when the cache is full: the caller then names the topic per
 * message.
 */
static rd_kafka_topic_t *
topic_handle(OutboxProducer *producer, const char *name, rd_kafka_resp_err_t *error)
{
	TopicEntry *entry;
	bool		found;

	*error = RD_KAFKA_RESP_ERR_NO_ERROR;
	if (strlen(name) > OUTBOX_TOPIC_MAX_LEN)
		return NULL;
	entry = hash_search(producer->topics, name, HASH_FIND, NULL);
	if (entry == NULL)
	{
		if (hash_get_num_entries(producer->topics) >= MAX_CACHED_TOPICS)
			return NULL;
		entry = hash_search(producer->topics, name, HASH_ENTER, &found);
		entry->rkt = rd_kafka_topic_new(producer->rk, name, NULL);
		entry->error = RD_KAFKA_RESP_ERR_NO_ERROR;
		if (entry->rkt == NULL)
		{
			hash_search(producer->topics, name, HASH_REMOVE, NULL);
			return NULL;
		}
		check_topic(producer, entry);
		wait_for_topic_creation(producer, entry);
	}
	else if (entry->error != RD_KAFKA_RESP_ERR_NO_ERROR &&
			 TimestampDifferenceExceeds(entry->checked_at, GetCurrentTimestamp(),
										TOPIC_ERROR_RECHECK_MS))
		check_topic(producer, entry);

	*error = entry->error;
	return entry->rkt;
}

/*
 * outbox_producer_send
 *		Queue one message as entry index of the current batch.
 *
 * Returns RD_KAFKA_RESP_ERR_NO_ERROR when queued (its delivery report will
 * fill deliveries[index]), or the error librdkafka raised at once:
 * _QUEUE_FULL (serve reports and try again), MSG_SIZE_TOO_LARGE,
 * _UNKNOWN_TOPIC, _FATAL and the like.  Key, value and headers are copied.
 */
rd_kafka_resp_err_t
outbox_producer_send(OutboxProducer *producer, int index,
					 const OutboxMessage *msg)
{
	rd_kafka_headers_t *headers;
	rd_kafka_resp_err_t err;
	rd_kafka_topic_t *rkt;
	uintptr_t	tag;
	int			i;

	Assert(index >= 0 && index < producer->capacity);

	headers = rd_kafka_headers_new(msg->nheaders);
	for (i = 0; i < msg->nheaders; i++)
		rd_kafka_header_add(headers, msg->header_names[i], -1,
							msg->header_values[i], msg->header_lens[i]);

	tag = ((uintptr_t) producer->generation << 32) | (uint32) index;
	rkt = topic_handle(producer, msg->topic, &err);
	if (err != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		rd_kafka_headers_destroy(headers);
		return err;
	}
	if (rkt != NULL)
		err = rd_kafka_producev(producer->rk,
								RD_KAFKA_V_RKT(rkt),
								RD_KAFKA_V_KEY(msg->key, msg->key_len),
								RD_KAFKA_V_VALUE((void *) msg->value, msg->value_len),
								RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
								RD_KAFKA_V_HEADERS(headers),
								RD_KAFKA_V_TIMESTAMP(msg->timestamp_ms),
								RD_KAFKA_V_OPAQUE((void *) tag),
								RD_KAFKA_V_END);
	else
		err = rd_kafka_producev(producer->rk,
								RD_KAFKA_V_TOPIC(msg->topic),
								RD_KAFKA_V_KEY(msg->key, msg->key_len),
								RD_KAFKA_V_VALUE((void *) msg->value, msg->value_len),
								RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
								RD_KAFKA_V_HEADERS(headers),
								RD_KAFKA_V_TIMESTAMP(msg->timestamp_ms),
								RD_KAFKA_V_OPAQUE((void *) tag),
								RD_KAFKA_V_END);
	if (err != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		/* headers are only taken over on success */
		rd_kafka_headers_destroy(headers);
		if (err == RD_KAFKA_RESP_ERR__FATAL)
			producer->fatal = true;
		return err;
	}
	producer->outstanding++;
	return RD_KAFKA_RESP_ERR_NO_ERROR;
}

/*
 * outbox_producer_serve
 *		Serve queued delivery reports, errors and log lines.  Never blocks.
 */
void
outbox_producer_serve(OutboxProducer *producer)
{
	char		buf[64];
	int			i;

	while (read(producer->wakeup_fd[0], buf, sizeof(buf)) > 0)
		;
	rd_kafka_poll(producer->rk, 0);

	/* librdkafka's own log (see debug in outbox.kafka_properties) */
	for (i = 0; i < producer->nlogs; i++)
		elog(DEBUG1, "librdkafka: %s", producer->logs[i]);
	if (producer->dropped_logs > 0)
		elog(DEBUG1, "librdkafka: %d more log lines dropped", producer->dropped_logs);
	producer->nlogs = 0;
	producer->dropped_logs = 0;
}

/*
 * outbox_producer_abort_batch
 *		Give up on what the current batch has not had acknowledged.
 *
 * Messages queued or in flight are purged; those in flight may still reach
 * Kafka, which is why delivery is at-least-once and why consumers
 * de-duplicate on the "id" header.
 */
void
outbox_producer_abort_batch(OutboxProducer *producer)
{
	producer->generation++;
	producer->outstanding = 0;
	rd_kafka_purge(producer->rk,
				   RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
	outbox_producer_serve(producer);
}

/*
 * outbox_producer_probe
 *		Ask a broker for cluster metadata, waiting at most timeout_ms.
 *		True if one answered.  Used to notice that Kafka is back while there
 *		is nothing to publish.
 */
bool
outbox_producer_probe(OutboxProducer *producer, int timeout_ms)
{
	const struct rd_kafka_metadata *md = NULL;

	if (rd_kafka_metadata(producer->rk, 0, NULL, &md, timeout_ms) !=
		RD_KAFKA_RESP_ERR_NO_ERROR)
		return false;
	rd_kafka_metadata_destroy(md);
	return true;
}

/*
 * outbox_producer_fatal_error
 *		The fatal error that stopped the producer, as text (palloc'd) with
 *		its code in *code, or NULL.  After a fatal error the producer must
 *		be destroyed and rebuilt.
 */
char *
outbox_producer_fatal_error(OutboxProducer *producer, rd_kafka_resp_err_t *code)
{
	char		errstr[512];
	rd_kafka_resp_err_t err;

	err = rd_kafka_fatal_error(producer->rk, errstr, sizeof(errstr));
	*code = err;
	if (err == RD_KAFKA_RESP_ERR_NO_ERROR && !producer->fatal)
		return NULL;
	if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
		return pstrdup(producer->last_error_text);
	return psprintf("%s: %s", rd_kafka_err2name(err), errstr);
}

/*
 * outbox_kafka_error_is_permanent
 *		True for delivery errors that retrying the same message cannot fix
 *		(the message or its topic is refused), as opposed to transient ones
 *		(broker down, timeouts, leader changes), which never count against
 *		an event.
 */
bool
outbox_kafka_error_is_permanent(rd_kafka_resp_err_t err)
{
	switch (err)
	{
		case RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE:
		case RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE:
		case RD_KAFKA_RESP_ERR_INVALID_RECORD:
		case RD_KAFKA_RESP_ERR_INVALID_MSG:
		case RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED:
		case RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION:
		case RD_KAFKA_RESP_ERR_INVALID_REQUIRED_ACKS:
		case RD_KAFKA_RESP_ERR_UNSUPPORTED_FOR_MESSAGE_FORMAT:
		case RD_KAFKA_RESP_ERR_POLICY_VIOLATION:
		case RD_KAFKA_RESP_ERR__INVALID_ARG:
			/*
			 * the timestamp (created_at) is outside the topic's
			 * message.timestamp.before/after.max.ms; it only gets older
			 */
		case RD_KAFKA_RESP_ERR_INVALID_TIMESTAMP:
			/* the message that made the producer stop (see gapless above) */
		case RD_KAFKA_RESP_ERR__GAPLESS_GUARANTEE:
			/* the topic does not exist and the broker will not create it */
		case RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART:
		case RD_KAFKA_RESP_ERR__UNKNOWN_TOPIC:
		case RD_KAFKA_RESP_ERR__UNKNOWN_PARTITION:
			return true;
		default:
			return false;
	}
}

/*
 * Delivery report: runs on the worker's thread inside rd_kafka_poll().
 * Only records; see the file header for why.
 */
static void
dr_msg_cb(rd_kafka_t *rk, const rd_kafka_message_t *msg, void *opaque)
{
	OutboxProducer *producer = (OutboxProducer *) opaque;
	uintptr_t	tag = (uintptr_t) msg->_private;
	uint32		generation = (uint32) (tag >> 32);
	uint32		index = (uint32) (tag & 0xFFFFFFFF);
	OutboxDelivery *d;

	if (generation != producer->generation || index >= (uint32) producer->capacity)
		return;
	d = &producer->deliveries[index];
	if (d->reported)
		return;
	d->reported = true;
	d->err = msg->err;
	d->status = rd_kafka_message_status(msg);
	d->partition = msg->partition;
	d->offset = msg->offset;
	producer->outstanding--;
}

/*
 * Error callback: transport errors, all brokers down, fatal errors.
 * Served by rd_kafka_poll() on the worker's thread; only records.
 */
static void
error_cb(rd_kafka_t *rk, int err, const char *reason, void *opaque)
{
	OutboxProducer *producer = (OutboxProducer *) opaque;

	/*
	 * "1/1 brokers are down" follows the error that brought them down (a
	 * refused SASL login, a TLS failure); keep that cause in the text.
	 */
	if (err == RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN && producer->cause_text[0] != '\0')
		snprintf(producer->last_error_text, sizeof(producer->last_error_text),
				 "%s; last error: %s", reason, producer->cause_text);
	else
		snprintf(producer->last_error_text, sizeof(producer->last_error_text),
				 "%s", reason);
	if (err != RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN)
		snprintf(producer->cause_text, sizeof(producer->cause_text), "%s", reason);
	producer->last_error = err;
	producer->error_seq++;
	if (err == RD_KAFKA_RESP_ERR__FATAL)
		producer->fatal = true;
	if (err == RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN)
		producer->all_brokers_down = true;
}

/*
 * librdkafka log line.  With log.queue=true and rd_kafka_set_log_queue()
 * this runs inside rd_kafka_poll() on the worker's thread (before the log
 * queue is set up it may run on librdkafka's own threads: so only record,
 * in the fixed buffer; outbox_producer_serve() passes them on).
 */
static void
log_cb(const rd_kafka_t *rk, int level, const char *fac, const char *buf)
{
	OutboxProducer *producer = (OutboxProducer *) rd_kafka_opaque(rk);

	if (producer == NULL)
		return;
	if (producer->nlogs >= OUTBOX_PRODUCER_LOG_LINES)
	{
		producer->dropped_logs++;
		return;
	}
	snprintf(producer->logs[producer->nlogs++], sizeof(producer->logs[0]),
			 "%d %s: %s", level, fac, buf);
}

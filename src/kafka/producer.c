/*-------------------------------------------------------------------------
 *
 * producer.c
 *	  The relay's Kafka producer, built on librdkafka: create and destroy
 *	  it, send a batch's messages, serve their delivery reports.
 *
 * Its configuration comes from kafka_config.c, its topic handles from
 * topic_cache.c.
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
 *	  partitioner puts a key on the partition a Java client would choose
 *	  (default_properties in kafka_config.c, which users cannot override).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "kafka/producer.h"
#include "config/guc.h"
#include "config/kafka_config.h"
#include "config/secrets.h"
#include "kafka/topic_cache.h"
#include "shared/shmem.h"

#include <fcntl.h>
#include <unistd.h>

#include "miscadmin.h"
#include "storage/latch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* after a purge, how long to wait for its delivery reports (ms) */
#define ABORT_DRAIN_MS		500

StaticAssertDecl(SIZEOF_VOID_P >= 8,
				 "delivery opaques pack a generation and an index into a pointer");

static bool set_transactional(rd_kafka_conf_t *conf, const char *transactional_id,
							  char **error);
static bool open_wakeup_pipe(OutboxProducer *producer);
static bool serve_until_reported(OutboxProducer *producer, int timeout_ms);
static void dr_msg_cb(rd_kafka_t *rk, const rd_kafka_message_t *msg,
					  void *opaque);
static void error_cb(rd_kafka_t *rk, int err, const char *reason,
					 void *opaque);
static void log_cb(const rd_kafka_t *rk, int level, const char *fac,
				   const char *buf);

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
outbox_producer_create(const char *transactional_id, char **error)
{
	OutboxProducer *producer;
	rd_kafka_conf_t *conf;
	char		errstr[512];

	conf = outbox_kafka_conf_new(outbox_bootstrap_servers,
								 outbox_delivery_timeout,
								 outbox_kafka_properties, error);
	if (conf == NULL)
		return NULL;
	if (transactional_id != NULL && !set_transactional(conf, transactional_id, error))
	{
		rd_kafka_conf_destroy(conf);
		return NULL;
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
		outbox_kafka_scrub_secrets(errstr, sizeof(errstr), outbox_kafka_properties);
		*error = psprintf("could not create the Kafka producer: %s", errstr);
		return NULL;
	}
	rd_kafka_set_log_queue(producer->rk, NULL);

	if (!open_wakeup_pipe(producer))
	{
		*error = psprintf("could not create the producer's wake-up pipe: %m");
		outbox_producer_destroy(producer);
		return NULL;
	}
	producer->topics = outbox_topic_cache_create();

	producer->bootstrap_servers = MemoryContextStrdup(TopMemoryContext,
													  outbox_bootstrap_servers);
	producer->kafka_properties = MemoryContextStrdup(TopMemoryContext,
													 outbox_kafka_properties);
	producer->delivery_timeout = outbox_delivery_timeout;
	if (transactional_id != NULL)
	{
		producer->transactional_id = MemoryContextStrdup(TopMemoryContext,
														 transactional_id);
		producer->progress_topic = MemoryContextStrdup(TopMemoryContext,
													   outbox_progress_topic);
	}
	return producer;
}

/*
 * Make the pipe librdkafka writes a byte to whenever events are queued on
 * its main queue; the worker waits on producer->wakeup_fd[0].  False, with
 * errno set, when the pipe cannot be made.
 */
/*
 * outbox.delivery = exactly_once: a transactional producer.  A transaction
 * that fails is aborted as a whole and sent again, so the gapless
 * guarantee (kafka_config.c), which stops the producer for good at the
 * first refused message, is not needed: it is turned off, and a refused
 * event costs an abort, not a new producer.
 */
static bool
set_transactional(rd_kafka_conf_t *conf, const char *transactional_id,
				  char **error)
{
	char		errstr[256];

	if (rd_kafka_conf_set(conf, "transactional.id", transactional_id,
						  errstr, sizeof(errstr)) != RD_KAFKA_CONF_OK ||
		rd_kafka_conf_set(conf, "enable.gapless.guarantee", "false",
						  errstr, sizeof(errstr)) != RD_KAFKA_CONF_OK)
	{
		*error = psprintf("could not make the producer transactional: %s", errstr);
		return false;
	}
	return true;
}

static bool
open_wakeup_pipe(OutboxProducer *producer)
{
	rd_kafka_queue_t *mainq;

	if (pipe(producer->wakeup_fd) != 0 ||
		fcntl(producer->wakeup_fd[0], F_SETFL, O_NONBLOCK) != 0 ||
		fcntl(producer->wakeup_fd[1], F_SETFL, O_NONBLOCK) != 0 ||
		fcntl(producer->wakeup_fd[0], F_SETFD, FD_CLOEXEC) != 0 ||
		fcntl(producer->wakeup_fd[1], F_SETFD, FD_CLOEXEC) != 0)
		return false;
	mainq = rd_kafka_queue_get_main(producer->rk);
	rd_kafka_queue_io_event_enable(mainq, producer->wakeup_fd[1], "1", 1);
	rd_kafka_queue_destroy(mainq);
	return true;
}

/*
 * outbox_producer_destroy
 *		Drop everything queued or in flight and free the producer.
 *
 * Purging first makes rd_kafka_destroy() return at once even when no broker
 * is reachable, so a fast shutdown stays fast.  Events not yet acknowledged
 * are still unpublished in the table and go out again later.  The
 * exactly_once alternate goes with it.  producer may be NULL, or half built
 * (outbox_producer_create).  Raises no ERROR.
 */
void
outbox_producer_destroy(OutboxProducer *producer)
{
	if (producer == NULL)
		return;
	outbox_producer_destroy(producer->alternate);
	if (producer->rk != NULL)
	{
		producer->generation++;
		rd_kafka_purge(producer->rk,
					   RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
		rd_kafka_poll(producer->rk, 0);
		if (producer->topics != NULL)
			outbox_topic_cache_destroy(producer->topics);
		rd_kafka_destroy(producer->rk);
		producer->rk = NULL;
	}
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
	if (producer->transactional_id)
		pfree(producer->transactional_id);
	if (producer->progress_topic)
		pfree(producer->progress_topic);
	pfree(producer);
}

/*
 * outbox_producer_settings_changed
 *		True if a reload changed a setting the producer was built with
 *		(outbox.bootstrap_servers, outbox.kafka_properties,
 *		outbox.delivery_timeout): then it must be rebuilt.
 */
bool
outbox_producer_settings_changed(OutboxProducer *producer)
{
	bool		transactional = outbox_delivery == OUTBOX_DELIVERY_EXACTLY_ONCE;

	if ((producer->transactional_id != NULL) != transactional ||
		(transactional && strcmp(producer->progress_topic, outbox_progress_topic) != 0))
		return true;
	return strcmp(producer->bootstrap_servers, outbox_bootstrap_servers) != 0 ||
		strcmp(producer->kafka_properties, outbox_kafka_properties) != 0 ||
		producer->delivery_timeout != outbox_delivery_timeout;
}

/*
 * outbox_producer_begin_batch
 *		Start a new batch of up to capacity messages.
 *
 * capacity is the batch's size in messages: deliveries[0..capacity-1] are
 * zeroed and filled by the delivery reports.  Reports that still arrive for
 * an earlier (aborted) batch carry an older generation and are ignored.
 * Raises ERROR only when out of memory.
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
 * outbox_producer_send
 *		Queue one message as entry index of the current batch.
 *
 * Returns RD_KAFKA_RESP_ERR_NO_ERROR when queued (its delivery report will
 * fill deliveries[index]), or the error librdkafka raised at once:
 * _QUEUE_FULL (serve reports and try again), MSG_SIZE_TOO_LARGE,
 * _UNKNOWN_TOPIC, _FATAL and the like.  Key, value and headers are copied.
 * index is 0..capacity-1 (outbox_producer_begin_batch).  The first message
 * to a topic may wait for the topic's metadata (topic_cache.c); nothing
 * here raises ERROR.
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
	rkt = outbox_topic_handle(producer->rk, producer->topics, msg->topic,
							  producer->all_brokers_down, &err);
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
 *		librdkafka's log lines are passed on at DEBUG1.
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
	{
		outbox_kafka_scrub_secrets(producer->logs[i], sizeof(producer->logs[i]),
								   producer->kafka_properties);
		elog(DEBUG1, "librdkafka: %s", producer->logs[i]);
	}
	if (producer->dropped_logs > 0)
		elog(DEBUG1, "librdkafka: %d more log lines dropped", producer->dropped_logs);
	producer->nlogs = 0;
	producer->dropped_logs = 0;
}

/*
 * outbox_producer_abort_batch
 *		Give up on what the current batch has not had acknowledged.
 *
 * Messages not yet sent are purged.  Those in flight are purged too, and
 * may still reach Kafka, which is why delivery is at-least-once and why
 * consumers de-duplicate on the "id" header; except after a fatal error,
 * when the brokers still answer them: then their answers are awaited first,
 * so that a message Kafka wrote is known as published rather than sent
 * twice (seen as 5 duplicates when small events shared a partition with a
 * refused one).
 *
 * The reports are served for this batch: the generation only moves on
 * afterwards.  Purged messages get _PURGE_* errors, which are no verdict;
 * a message the broker refused keeps its refusal.  That matters because a
 * refusal is what stops the producer on purpose (gapless guarantee, see
 * kafka_config.c), and the error callback can be served before the refused
 * message's own report: dropping that report sent the event again, blind,
 * with a new producer, to be refused again, until a report won the race
 * (seen as a 150 KB event and an old one re-sent for 3 s).
 *
 * Waits at most 2 * ABORT_DRAIN_MS (ms) for the reports; raises no ERROR.
 */
void
outbox_producer_abort_batch(OutboxProducer *producer)
{
	bool		await_in_flight = producer->fatal;

	rd_kafka_purge(producer->rk, RD_KAFKA_PURGE_F_QUEUE |
				   (await_in_flight ? 0 : RD_KAFKA_PURGE_F_INFLIGHT));
	if (!serve_until_reported(producer, ABORT_DRAIN_MS) && await_in_flight)
	{
		rd_kafka_purge(producer->rk, RD_KAFKA_PURGE_F_INFLIGHT);
		(void) serve_until_reported(producer, ABORT_DRAIN_MS);
	}
	producer->generation++;
	producer->outstanding = 0;
}

/*
 * Serve delivery reports until every message of the batch has one, for at
 * most timeout_ms (ms).  True if all came.
 */
static bool
serve_until_reported(OutboxProducer *producer, int timeout_ms)
{
	TimestampTz start = GetCurrentTimestamp();

	for (;;)
	{
		outbox_producer_serve(producer);
		if (producer->outstanding <= 0)
			return true;
		if (TimestampDifferenceExceeds(start, GetCurrentTimestamp(), timeout_ms))
			return false;
		(void) WaitLatchOrSocket(NULL, WL_SOCKET_READABLE | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
								 producer->wakeup_fd[0], 10,
								 outbox_wait_event(OUTBOX_WAIT_DELIVERY));
	}
}

/*
 * outbox_producer_probe
 *		Ask a broker for cluster metadata, waiting at most timeout_ms (ms).
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
		return pstrdup(producer->last_error_text[0] != '\0' ?
					   producer->last_error_text :
					   "librdkafka gave no reason");
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

			/*
			 * the message that made the producer stop (see
			 * enable.gapless.guarantee in kafka_config.c)
			 */
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
	outbox_kafka_scrub_secrets(producer->last_error_text, sizeof(producer->last_error_text),
							   producer->kafka_properties);
	if (err != RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN)
	{
		snprintf(producer->cause_text, sizeof(producer->cause_text), "%s", reason);
		outbox_kafka_scrub_secrets(producer->cause_text, sizeof(producer->cause_text),
								   producer->kafka_properties);
	}
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

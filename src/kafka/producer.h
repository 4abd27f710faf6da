/*-------------------------------------------------------------------------
 *
 * producer.h
 *	  The relay's Kafka producer: a thin layer over librdkafka.
 *
 * librdkafka runs its own threads.  None of them may ever call into
 * PostgreSQL, so every callback we install only records what happened into
 * memory allocated beforehand; the worker reads those records after
 * rd_kafka_poll() returns, on its own thread, and does the logging and SPI.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_PRODUCER_H
#define OUTBOX_PRODUCER_H

#include <librdkafka/rdkafka.h>

/* librdkafka log lines kept between two polls */
#define OUTBOX_PRODUCER_LOG_LINES	32

/* outcome of one message of the current batch, filled by the DR callback */
typedef struct OutboxDelivery
{
	bool		reported;		/* delivery report received */
	rd_kafka_resp_err_t err;	/* RD_KAFKA_RESP_ERR_NO_ERROR = acknowledged */
	rd_kafka_msg_status_t status;	/* persisted / possibly / not */
	int32		partition;
	int64		offset;
} OutboxDelivery;

/* one Kafka message as the relay builds it from an outbox row */
typedef struct OutboxMessage
{
	const char *topic;
	const char *key;
	size_t		key_len;
	const char *value;			/* NULL: tombstone */
	size_t		value_len;
	int64		timestamp_ms;	/* CreateTime, ms since the Unix epoch */
	int			nheaders;
	const char **header_names;
	const char **header_values;
	size_t	   *header_lens;
} OutboxMessage;

typedef struct OutboxProducer
{
	rd_kafka_t *rk;
	struct HTAB *topics;		/* topic name -> rd_kafka_topic_t handle
								 * (topic_cache.c) */
	int			wakeup_fd[2];	/* librdkafka writes [1] when events queue */

	/* settings the producer was built with, to detect a reload */
	char	   *bootstrap_servers;
	char	   *kafka_properties;
	int			delivery_timeout;
	char	   *transactional_id;	/* exactly_once: transactional.id, else NULL */
	char	   *progress_topic;	/* exactly_once: outbox.progress_topic */
	/* exactly_once: the second transactional producer, used in turn */
	struct OutboxProducer *alternate;

	/* the batch in flight: deliveries are indexed by position in batch */
	uint32		generation;
	OutboxDelivery *deliveries;
	int			capacity;
	int			outstanding;

	/* written by callbacks (on the polling thread), read by the worker */
	bool		fatal;
	uint64		error_seq;
	rd_kafka_resp_err_t last_error;
	char		last_error_text[512];
	char		cause_text[256];	/* last error other than "all brokers down" */
	bool		all_brokers_down;
	/* librdkafka's log lines, passed on at DEBUG1 after each poll */
	int			nlogs;
	int			dropped_logs;
	char		logs[OUTBOX_PRODUCER_LOG_LINES][256];
} OutboxProducer;

extern OutboxProducer *outbox_producer_create(const char *transactional_id,
											  char **error);
extern void outbox_producer_destroy(OutboxProducer *producer);
extern bool outbox_producer_settings_changed(OutboxProducer *producer);
extern void outbox_producer_begin_batch(OutboxProducer *producer, int capacity);
extern rd_kafka_resp_err_t outbox_producer_send(OutboxProducer *producer,
												int index,
												const OutboxMessage *msg);
extern void outbox_producer_serve(OutboxProducer *producer);
extern void outbox_producer_abort_batch(OutboxProducer *producer);
extern bool outbox_producer_probe(OutboxProducer *producer, int timeout_ms);
extern char *outbox_producer_fatal_error(OutboxProducer *producer,
										 rd_kafka_resp_err_t *code);
extern bool outbox_kafka_error_is_permanent(rd_kafka_resp_err_t err);

#endif							/* OUTBOX_PRODUCER_H */

/*-------------------------------------------------------------------------
 *
 * inbox_consumer_int.h
 *	  The inside of an inbox worker's consumer, shared by the files that
 *	  drive it (inbox_consumer.c, inbox_assign.c) and nobody else.
 *
 *-------------------------------------------------------------------------
 */
#ifndef INBOX_CONSUMER_INT_H
#define INBOX_CONSUMER_INT_H

#include "outbox.h"

#include <librdkafka/rdkafka.h>

#include "datatype/timestamp.h"

/* log lines kept between two polls */
#define CONSUMER_LOG_LINES		16

struct InboxConsumer
{
	rd_kafka_t *rk;
	rd_kafka_queue_t *queue;	/* the consumer queue: records */
	char	   *servers;		/* the settings it was built with */
	char	   *properties;
	/* written by the callbacks, on the worker's thread */
	bool		brokers_down;
	char		error[OUTBOX_ERROR_LEN];
	bool		error_unscrubbed;	/* error_cb wrote error: scrub it in this
									 * process before anyone reads it */
	int			nlogs;
	char		logs[CONSUMER_LOG_LINES][256];
	/* what rd_kafka_assign() or a seek was last given (inbox_assign.c) */
	rd_kafka_topic_partition_list_t *given;
	TimestampTz last_removal;	/* when rd_kafka_assign() last removed
									 * partitions, or 0 */
};

#endif							/* INBOX_CONSUMER_INT_H */

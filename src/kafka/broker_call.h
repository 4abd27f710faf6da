/*-------------------------------------------------------------------------
 *
 * broker_call.h
 *	  Blocking librdkafka requests asked in short steps, so that a stop
 *	  never waits for a silent broker (broker_call.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_BROKER_CALL_H
#define OUTBOX_BROKER_CALL_H

#include <librdkafka/rdkafka.h>

extern rd_kafka_resp_err_t outbox_kafka_metadata(rd_kafka_t *rk,
												 rd_kafka_topic_t *rkt,
												 const struct rd_kafka_metadata **md,
												 int timeout_ms);
extern rd_kafka_resp_err_t outbox_kafka_watermarks(rd_kafka_t *rk,
												   const char *topic,
												   int32_t partition,
												   int64_t *low, int64_t *high,
												   int timeout_ms);

#endif							/* OUTBOX_BROKER_CALL_H */

/*-------------------------------------------------------------------------
 *
 * batch.h
 *	  The relay as worker.c calls it: one relay batch (batch.c) claims
 *	  committed events, publishes them and marks what Kafka acknowledged;
 *	  batch_report.c tells the status what it did.  Retention, which
 *	  deletes published events once they expired, has its own header
 *	  (relay/retention.h).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_BATCH_H
#define OUTBOX_BATCH_H

#include "kafka/producer.h"
#include "relay/relay.h"

extern void outbox_relay_batch(OutboxProducer *producer,
							   OutboxBatchResult *result);

/* batch_report.c */
extern void outbox_report_batch(const OutboxBatchResult *result);
extern void outbox_update_broker_state(OutboxProducer *producer,
									   const OutboxBatchResult *result);

#endif							/* OUTBOX_BATCH_H */

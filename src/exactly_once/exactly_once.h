/*-------------------------------------------------------------------------
 *
 * exactly_once.h
 *	  outbox.delivery = exactly_once: progress records in Kafka
 *	  transactions, read back after a crash.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_EXACTLY_ONCE_H
#define OUTBOX_EXACTLY_ONCE_H

#include "kafka/producer.h"
#include "relay/message.h"
#include "relay/relay.h"
#include "relay/snapshot.h"

typedef enum OutboxEosStart
{
	OUTBOX_EOS_READY,			/* transactions initialized, progress read back */
	OUTBOX_EOS_UNAVAILABLE,		/* Kafka did not answer: try again later */
	OUTBOX_EOS_REFUSED			/* a setting or the progress topic is wrong */
} OutboxEosStart;

extern char *outbox_eos_transactional_id(void);
extern OutboxEosStart outbox_eos_start(OutboxProducer *producer, char **error);
extern OutboxProducer *outbox_eos_alternate(OutboxProducer *producer);
extern bool outbox_eos_begin(OutboxProducer *producer, OutboxBatchResult *result);
extern char *outbox_eos_snapshot_record(const OutboxSnapshotBatch *sb,
										const Batch *batch);
extern char *outbox_eos_rows_record(const Batch *batch);
extern bool outbox_eos_add_record(OutboxProducer *producer, const char *record,
								  int index);
extern bool outbox_eos_commit(OutboxProducer *producer, int index,
							  OutboxBatchResult *result);
extern void outbox_eos_abort(OutboxProducer *producer, OutboxBatchResult *result);
extern int	outbox_eos_keep_refusals(OutboxProducer *producer, BatchEntry *entries,
									 int n, bool *transient);

#endif							/* OUTBOX_EXACTLY_ONCE_H */

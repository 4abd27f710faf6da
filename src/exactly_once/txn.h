/*-------------------------------------------------------------------------
 *
 * txn.h
 *	  The transactional producer's calls (outbox.delivery = exactly_once),
 *	  made interruptible and sorted into the outcomes the relay acts on.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_TXN_H
#define OUTBOX_TXN_H

#include "kafka/producer.h"

/* what a transactional call came to */
typedef enum OutboxTxnOutcome
{
	OUTBOX_TXN_OK,				/* done */
	OUTBOX_TXN_UNAVAILABLE,		/* timed out or coordinator unreachable:
								 * try again later */
	OUTBOX_TXN_ABORTABLE,		/* this transaction failed: abort it, send
								 * the batch again */
	OUTBOX_TXN_FATAL			/* fenced or broken: rebuild the producer */
} OutboxTxnOutcome;

extern OutboxTxnOutcome outbox_txn_init(OutboxProducer *producer, int timeout_ms,
										char **error);
extern OutboxTxnOutcome outbox_txn_begin(OutboxProducer *producer, char **error);
extern OutboxTxnOutcome outbox_txn_commit(OutboxProducer *producer, int timeout_ms,
										  char **error);
extern OutboxTxnOutcome outbox_txn_abort(OutboxProducer *producer, int timeout_ms,
										 char **error);
extern char *outbox_progress_topic_check(OutboxProducer *producer,
										 const char *topic, int timeout_ms,
										 bool *unavailable);

#endif							/* OUTBOX_TXN_H */

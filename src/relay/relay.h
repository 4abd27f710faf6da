/*-------------------------------------------------------------------------
 *
 * relay.h
 *	  The relay as worker.c calls it: one relay batch (batch.c) claims
 *	  committed events, publishes them and marks what Kafka acknowledged.
 *	  Retention, which deletes published events once they expired, has its
 *	  own header (retention.h).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_RELAY_H
#define OUTBOX_RELAY_H

#include "producer.h"

typedef struct OutboxBatchResult
{
	bool		table_missing;	/* outbox.events does not exist (yet) */
	bool		paused;			/* outbox.pause() is in effect */
	int			claimed;		/* rows read from the table */
	int			published;		/* acknowledged by Kafka, marked published */
	int			failed_permanent;	/* refused by Kafka or invalid */
	int			failed_transient;	/* timed out, broker unreachable, ... */
	int			failed_unattributed;	/* refused with others in one request;
										 * sent again alone (not counted) */
	int			dead_lettered;	/* marked failed by this batch */
	int			held_back;		/* waiting behind a failed event */
	int			overtaken;		/* published after an earlier failed event
								 * of the same aggregate */
	bool		aborted;		/* reports abandoned; rows stay unpublished */
	bool		rows_held;		/* row-tracked events were due, none could be
								 * claimed: all wait behind a failed one */
	bool		fatal;			/* the producer must be rebuilt */
	char	   *first_error;	/* text of the first failure, or NULL */
	MemoryContext cxt;			/* where first_error lives: the caller's */
} OutboxBatchResult;

extern void outbox_relay_batch(OutboxProducer *producer,
							   OutboxBatchResult *result);

/* batch_report.c */
extern void outbox_report_batch(const OutboxBatchResult *result);
extern void outbox_update_broker_state(OutboxProducer *producer,
									   const OutboxBatchResult *result);

#endif							/* OUTBOX_RELAY_H */

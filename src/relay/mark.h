/*-------------------------------------------------------------------------
 *
 * mark.h
 *	  Delivery reports go back into the event rows (mark.c): published,
 *	  deleted, retried, failed.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_MARK_H
#define OUTBOX_MARK_H

#include "kafka/producer.h"
#include "relay/message.h"

/* what marking a batch did, counted by event (see OutboxBatchResult) */
typedef struct MarkCounts
{
	int			published;		/* acknowledged by Kafka */
	int			failed_permanent;	/* refused by Kafka or invalid */
	int			failed_transient;	/* timed out, broker unreachable, ... */
	int			failed_unattributed;	/* refused with others in one request */
	int			dead_lettered;	/* marked failed */
	int			held_back;		/* waiting behind a failed event */
	int			overtaken;		/* published after an earlier failed event
								 * of the same aggregate */
	char	   *first_error;	/* text of the first failure, or NULL */
	MemoryContext cxt;			/* where first_error is put: the caller's */
} MarkCounts;

extern void outbox_mark_results(OutboxProducer *producer, BatchEntry *entries,
								int n, bool dead_letters, bool by_snapshot,
								MarkCounts *counts);
extern bool outbox_delivery_failed(const BatchEntry *e,
								   const OutboxDelivery *d);
extern int64 outbox_highest_published_id(void);

#endif							/* OUTBOX_MARK_H */

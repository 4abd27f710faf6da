/*-------------------------------------------------------------------------
 *
 * relay.h
 *	  What one relay batch (worker/batch.c) yields: events claimed,
 *	  published, failed, and whether the producer must be rebuilt.  Filled
 *	  in by the batch and by exactly_once/, read by worker/.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_RELAY_H
#define OUTBOX_RELAY_H

#include "utils/palloc.h"

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

#endif							/* OUTBOX_RELAY_H */

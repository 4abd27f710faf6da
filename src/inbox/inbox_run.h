/*-------------------------------------------------------------------------
 *
 * inbox_run.h
 *	  What one run of a batch shares between the apply transaction's files:
 *	  inbox_apply.c (the runs, their failures and reruns) and inbox_batch.c
 *	  (a Kafka batch settled set-based in one run).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_INBOX_RUN_H
#define OUTBOX_INBOX_RUN_H

#include "inbox/inbox.h"

/* a record that failed in an earlier run of its batch */
typedef struct Verdict
{
	bool		failed;
	char	   *error;
	char		sqlstate[6];
	int			attempts;		/* failed calls, when failed */
	int			transient;		/* runs it failed with a transient error */
} Verdict;

/* keys that failed in this run (on_failed_event = hold) */
typedef struct HeldKeys
{
	int			n;
	int			max;
	const char **topics;
	text	  **keys;
} HeldKeys;

/* what a run did to one partition */
typedef struct Tally
{
	bool		touched;
	int64		last;			/* offset of its last record in the batch */
	uint64		last_hash;		/* its fingerprint, the partition's new witness */
	int64		applied;
	int64		duplicates;
} Tally;

typedef enum Outcome
{
	OUTCOME_APPLIED,
	OUTCOME_DUPLICATE,
	OUTCOME_HELD,
	OUTCOME_DEAD
} Outcome;

/* how a run ended when it did not commit */
typedef struct Failure
{
	int			index;			/* the record being applied, or -1 */
	ErrorData  *edata;
	bool		cancelled;		/* 57014 not from the handler timeout */
	bool		recreated;		/* a partition's topic was re-created */
} Failure;

/* failure->index of an error raised by the call of a batch handler, or the queue insert */
#define INBOX_RUN_WHOLE_BATCH	(-2)

extern void inbox_run_begin(InboxSubscription *sub);
extern void inbox_run_end(void);
extern void inbox_run_catch(Failure *failure, volatile int *current,
							MemoryContext cxt);
extern bool inbox_held_here(HeldKeys *held, const InboxEvent *ev);
extern void inbox_hold_key(HeldKeys *held, const InboxEvent *ev);
extern bool inbox_run_kafka_batch(InboxSubscription *sub,
								  rd_kafka_message_t **msgs, int n,
								  Verdict *verdicts, Tally *tallies,
								  Failure *failure);

#endif							/* OUTBOX_INBOX_RUN_H */

/*-------------------------------------------------------------------------
 *
 * inbox_apply.c
 *	  The apply transaction: a batch of Kafka records of one subscription
 *	  applied in one transaction, with the offsets of their partitions.
 *
 * For each record, in offset order per partition:
 *	- a record below the partition's next_offset was applied already: skip;
 *	- a record whose key is held (on_failed_event = hold, a dead letter of
 *	  its topic and key exists) becomes a held dead letter;
 *	- a record whose event_id was applied within the window is a duplicate;
 *	- otherwise it is applied (the handler is called, or it is queued) and
 *	  its id recorded among the seen ones.
 * Then each partition's next_offset moves past its last record by
 * compare-and-set (inbox_offsets.c), and the transaction commits: effects,
 * seen ids, dead letters and offsets together, or none of them.
 *
 * The batch runs without savepoints: a subtransaction per record would make
 * a batch of more than 64 writing records "suboverflowed", which slows
 * every snapshot of the server.  So when a handler fails, the whole batch
 * rolls back and runs again with that record written as a dead letter
 * instead (pipeline_kafka dropped the whole batch there; the Kafka Connect
 * sinks "unroll" it the same way).  Each run settles at least one record,
 * so a batch of n records runs at most n + 1 times.  A transient error
 * (serialization failure, deadlock, lock timeout, a cancel, resources) runs
 * the batch again after a pause, up to outbox.inbox_max_attempts times,
 * before the record counts as failed.  An error that is no record's (the
 * offset moved, the database went read-only) propagates: the worker reads
 * its offsets again and starts over from them.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox_run.h"
#include "shared/shmem.h"

#include "access/xact.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"

/* pause before a transient error's retry: doubles from this (ms) ... */
#define TRANSIENT_PAUSE_MIN_MS	100
/* ... up to this */
#define TRANSIENT_PAUSE_MAX_MS	5000

static void apply_run(InboxSubscription *sub, rd_kafka_message_t **msgs, int n,
					  Verdict *verdicts);
static void crashed(InboxSubscription *sub, Verdict *v, rd_kafka_message_t *msg,
					int ends);
static bool run_retry(InboxSubscription *sub, int64 *ids, Verdict *verdicts,
					  int max, int *n, Failure *failure);
static Outcome settle(InboxSubscription *sub, InboxEvent *ev, Verdict *v,
					  HeldKeys *held);
static bool judge(InboxSubscription *sub, Verdict *v, const char *where,
				  Failure *failure);
static void transient_pause(InboxSubscription *sub, int k, const char *where,
							ErrorData *edata);

/*
 * inbox_sqlstate_is_transient
 *		Is an error with this SQLSTATE worth a retry of the same record:
 *		serialization failure, deadlock, lock not available, insufficient
 *		resources?
 */
bool
inbox_sqlstate_is_transient(int sqlerrcode)
{
	return sqlerrcode == ERRCODE_T_R_SERIALIZATION_FAILURE ||
		sqlerrcode == ERRCODE_T_R_DEADLOCK_DETECTED ||
		sqlerrcode == ERRCODE_LOCK_NOT_AVAILABLE ||
		ERRCODE_TO_CATEGORY(sqlerrcode) == ERRCODE_INSUFFICIENT_RESOURCES;
}

/*
 * inbox_apply_batch
 *		Apply msgs[0..n-1], records of sub's consumer, until every one is
 *		applied, a duplicate or a dead letter (see the file header).  On
 *		return the partitions' next_offset in sub are the committed ones.
 *		The caller keeps and later destroys the messages.  An error that is
 *		no record's is raised.
 *
 * The record the previous worker ended in (inbox_attempts.c) is applied
 * alone, after an attempt mark; the others in runs of consecutive records,
 * so that each partition keeps its order.
 */
void
inbox_apply_batch(InboxSubscription *sub, rd_kafka_message_t **msgs, int n)
{
	Verdict    *verdicts = palloc0(sizeof(Verdict) * n);
	int			start = 0;
	int			i;

	for (i = 0; i <= n; i++)
	{
		InboxPartition *part = i < n ?
			inbox_find_partition(sub, rd_kafka_topic_name(msgs[i]->rkt), msgs[i]->partition) :
			NULL;

		if (i < n && (part == NULL || !inbox_attempts_careful(sub, part, msgs[i]->offset)))
			continue;
		if (i > start)
			apply_run(sub, msgs + start, i - start, verdicts + start);
		if (i < n)
		{
			int			ends = inbox_attempts_mark(sub, part, msgs[i]->offset);

			if (ends >= outbox_inbox_max_attempts)
				crashed(sub, &verdicts[i], msgs[i], ends);
			apply_run(sub, msgs + i, 1, verdicts + i);
		}
		start = i + 1;
	}
	inbox_attempts_end_batch(sub);
	for (i = 0; i < n; i++)
		if (verdicts[i].failed)
		{
			inbox_count(0, 1, 0);
			inbox_note_dead(verdicts[i].error);
		}
}

/*
 * The verdict on a record the worker ended in ends times: a dead letter,
 * without another call.
 */
static void
crashed(InboxSubscription *sub, Verdict *v, rd_kafka_message_t *msg, int ends)
{
	v->failed = true;
	v->error = psprintf("the inbox worker ended %d times while it applied this record (the handler crashed its process, or the process was killed)",
						ends);
	strlcpy(v->sqlstate, unpack_sql_state(ERRCODE_INTERNAL_ERROR), sizeof(v->sqlstate));
	v->attempts = ends;
	ereport(WARNING,
			(errmsg("outbox inbox: subscription \"%s\": the record at topic \"%s\", partition %d, offset %lld becomes a dead letter",
					sub->name, rd_kafka_topic_name(msg->rkt), msg->partition,
					(long long) msg->offset),
			 errdetail("%s.", v->error),
			 errhint("See outbox.inbox_dead; outbox.inbox_retry('%s') applies it again.", sub->name)));
}

/*
 * Apply one run of consecutive records msgs[0..n-1] with their verdicts
 * (see inbox_apply_batch), running it again until it commits.
 */
static void
apply_run(InboxSubscription *sub, rd_kafka_message_t **msgs, int n,
		  Verdict *verdicts)
{
	Tally	   *tallies = palloc0(sizeof(Tally) * Max(sub->npartitions, 1));
	int64		applied = 0;
	int			whole_transient = 0;
	int			i;

	for (;;)
	{
		Failure		failure = {-1, NULL, false, false};
		char	   *where;

		memset(tallies, 0, sizeof(Tally) * Max(sub->npartitions, 1));
		if (inbox_run_kafka_batch(sub, msgs, n, verdicts, tallies, &failure))
			break;
		/* run again without the partition that stalls now */
		if (failure.recreated)
			continue;
		/* a batch handler (or the queue insert) failed: whose record was it? */
		if (failure.index == INBOX_RUN_WHOLE_BATCH && n == 1)
			failure.index = 0;
		else if (failure.index == INBOX_RUN_WHOLE_BATCH)
		{
			inbox_count(0, 0, 1);
			if ((failure.cancelled || inbox_sqlstate_is_transient(failure.edata->sqlerrcode)) &&
				whole_transient + 1 < outbox_inbox_max_attempts)
			{
				transient_pause(sub, whole_transient++, "the batch", failure.edata);
				continue;
			}
			ereport(DEBUG1,
					(errmsg("outbox inbox: subscription \"%s\": the batch handler failed on %d records; applying them in two halves",
							sub->name, n),
					 errdetail("%s", failure.edata->message)));
			apply_run(sub, msgs, n / 2, verdicts);
			apply_run(sub, msgs + n / 2, n - n / 2, verdicts + n / 2);
			return;
		}
		if (failure.index < 0)
			ReThrowError(failure.edata);
		where = psprintf("topic \"%s\", partition %d, offset %lld",
						 rd_kafka_topic_name(msgs[failure.index]->rkt),
						 msgs[failure.index]->partition,
						 (long long) msgs[failure.index]->offset);
		(void) judge(sub, &verdicts[failure.index], where, &failure);
	}
	for (i = 0; i < sub->npartitions; i++)
	{
		if (!tallies[i].touched)
			continue;
		sub->partitions[i].next_offset = tallies[i].last + 1;
		sub->partitions[i].witness_offset = tallies[i].last;
		sub->partitions[i].witness_hash = tallies[i].last_hash;
		applied += tallies[i].applied;
		inbox_status_applied(sub->partitions[i].status);
	}
	inbox_count(applied, 0, 0);
}

/*
 * The pause before the run after the k-th transient error at where (a
 * record, or the batch), logged.
 */
static void
transient_pause(InboxSubscription *sub, int k, const char *where,
				ErrorData *edata)
{
	long		pause = Min((long) TRANSIENT_PAUSE_MIN_MS << Min(k, 6),
							TRANSIENT_PAUSE_MAX_MS);

	ereport(LOG,
			(errmsg("outbox inbox: subscription \"%s\": the handler failed at %s with a transient error, trying again in %ld ms",
					sub->name, where, pause),
			 errdetail("%s (SQLSTATE %s)", edata->message,
					   unpack_sql_state(edata->sqlerrcode))));
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 pause, outbox_wait_event(OUTBOX_WAIT_ERROR_BACKOFF));
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
}

/*
 * After a run failed at a record: decide its verdict.  A transient error
 * (or a cancel) leaves it undecided for another run, after a pause, until
 * the record failed so in outbox.inbox_max_attempts runs; any other error
 * makes it a dead letter in the next run.  where names the record for the
 * log.  Returns true if the record is now failed.
 */
static bool
judge(InboxSubscription *sub, Verdict *v, const char *where, Failure *failure)
{
	ErrorData  *edata = failure->edata;

	inbox_count(0, 0, 1);
	if ((failure->cancelled || inbox_sqlstate_is_transient(edata->sqlerrcode)) &&
		v->transient + 1 < outbox_inbox_max_attempts)
	{
		transient_pause(sub, v->transient++, where, edata);
		return false;
	}
	v->failed = true;
	v->error = pstrdup(edata->message ? edata->message : "unknown error");
	strlcpy(v->sqlstate, unpack_sql_state(edata->sqlerrcode), sizeof(v->sqlstate));
	v->attempts = v->transient + 1;
	ereport(WARNING,
			(errmsg("outbox inbox: subscription \"%s\": the handler failed at %s; the event becomes a dead letter",
					sub->name, where),
			 errdetail("%s (SQLSTATE %s)", v->error, v->sqlstate),
			 errhint("See outbox.inbox_dead; outbox.inbox_retry('%s') applies it again.", sub->name)));
	return true;
}

/*
 * PG_CATCH part shared by both kinds of run: keep the error, roll the
 * transaction back (which also undoes the handler's user, settings and
 * SPI), and note which record was being settled.
 */
void
inbox_run_catch(Failure *failure, volatile int *current, MemoryContext cxt)
{
	bool		timed_out;

	MemoryContextSwitchTo(cxt);
	HOLD_INTERRUPTS();
	inbox_attempts_called();
	timed_out = inbox_handler_cleanup();
	failure->edata = CopyErrorData();
	FlushErrorState();
	AbortCurrentTransaction();
	RESUME_INTERRUPTS();
	failure->index = *current;
	failure->cancelled = failure->edata->sqlerrcode == ERRCODE_QUERY_CANCELED && !timed_out;
	/* say which setting cut the call short, for the dead letter and the log */
	if (timed_out && failure->edata->sqlerrcode == ERRCODE_QUERY_CANCELED)
		failure->edata->message =
			psprintf("the handler ran longer than outbox.inbox_handler_timeout (%d ms): %s",
					 outbox_inbox_handler_timeout,
					 failure->edata->message ? failure->edata->message : "canceled");
}

/* is ev's key among those that failed in this run? */
bool
inbox_held_here(HeldKeys *held, const InboxEvent *ev)
{
	int			i;

	for (i = 0; i < held->n; i++)
		if (strcmp(held->topics[i], ev->topic) == 0 &&
			VARSIZE_ANY_EXHDR(held->keys[i]) == VARSIZE_ANY_EXHDR(ev->key) &&
			memcmp(VARDATA_ANY(held->keys[i]), VARDATA_ANY(ev->key),
				   VARSIZE_ANY_EXHDR(ev->key)) == 0)
			return true;
	return false;
}

void
inbox_hold_key(HeldKeys *held, const InboxEvent *ev)
{
	if (ev->key == NULL || inbox_held_here(held, ev))
		return;
	if (held->n == held->max)
	{
		held->max = Max(8, held->max * 2);
		held->topics = held->topics ? repalloc(held->topics, sizeof(char *) * held->max) :
			palloc(sizeof(char *) * held->max);
		held->keys = held->keys ? repalloc(held->keys, sizeof(text *) * held->max) :
			palloc(sizeof(text *) * held->max);
	}
	held->topics[held->n] = ev->topic;
	held->keys[held->n++] = ev->key;
}

/*
 * Settle one event (see the file header) in the current transaction.  v is
 * its verdict from earlier runs.  A retried dead letter (ev->dead_id set)
 * is deleted once applied or found a duplicate, and updated when it fails
 * again or stays held.
 */
static Outcome
settle(InboxSubscription *sub, InboxEvent *ev, Verdict *v, HeldKeys *held)
{
	bool		retry = ev->dead_id != 0;
	bool		dedupe = sub->dedupe && ev->has_event_id;

	if (v->failed || (sub->hold && ev->key != NULL &&
					  (inbox_held_here(held, ev) ||
					   (!retry && sub->has_dead && inbox_key_held(sub->name, ev)))))
	{
		if (dedupe && inbox_dedupe_seen(sub->name, &ev->event_id))
		{
			if (retry)
				inbox_dead_resolve(ev->dead_id);
			return OUTCOME_DUPLICATE;
		}
		if (sub->hold)
			inbox_hold_key(held, ev);
		if (retry)
			inbox_dead_failed_again(ev->dead_id, v->failed ? v->error : NULL,
									v->failed ? v->sqlstate : NULL,
									ev->attempts + Max(v->attempts, 1));
		else if (v->failed)
			inbox_dead_insert(sub->name, ev, false, v->error, v->sqlstate, v->attempts);
		else
			inbox_dead_insert(sub->name, ev, true, NULL, NULL, 0);
		return v->failed ? OUTCOME_DEAD : OUTCOME_HELD;
	}
	if (dedupe && !inbox_dedupe_record(sub->name, &ev->event_id))
	{
		if (retry)
			inbox_dead_resolve(ev->dead_id);
		return OUTCOME_DUPLICATE;
	}
	inbox_apply_event(sub, ev);
	if (retry)
		inbox_dead_resolve(ev->dead_id);
	return OUTCOME_APPLIED;
}

/* the transaction's start shared by both kinds of run */
void
inbox_run_begin(InboxSubscription *sub)
{
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	inbox_lock_subscription(sub);
	inbox_dedupe_begin_batch();
	inbox_handler_prepare(sub);
	sub->has_dead = sub->hold && inbox_dead_exist(sub->name);
}

void
inbox_run_end(void)
{
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_stat(false);
}

/*
 * inbox_retry_dead
 *		Apply again the dead letters outbox.inbox_retry() asked for, in id
 *		order (inbox_dead_load_retry), in one transaction, with the same
 *		runs as a Kafka batch: one that fails again stays a dead letter
 *		(and, on_failed_event = hold, so do the later ones of its key).
 */
void
inbox_retry_dead(InboxSubscription *sub)
{
	int			max = 16;
	int64	   *ids = palloc0(sizeof(int64) * max);
	Verdict    *verdicts = palloc0(sizeof(Verdict) * max);
	int			n = 0;

	for (;;)
	{
		Failure		failure = {-1, NULL, false, false};
		int			i;

		if (run_retry(sub, ids, verdicts, max, &n, &failure))
			break;
		if (n > max)
		{
			/* more dead letters than slots for their verdicts: grow, run again */
			ids = repalloc(ids, sizeof(int64) * n);
			verdicts = repalloc(verdicts, sizeof(Verdict) * n);
			memset(verdicts + max, 0, sizeof(Verdict) * (n - max));
			memset(ids + max, 0, sizeof(int64) * (n - max));
			max = n;
			continue;
		}
		if (failure.index < 0)
			ReThrowError(failure.edata);
		i = failure.index;
		(void) judge(sub, &verdicts[i],
					 psprintf("dead letter %lld", (long long) ids[i]),
					 &failure);
	}
	sub->retry_pending = false;
}

/*
 * One run of a retry in one transaction.  ids and verdicts (max slots) keep
 * the verdicts of the dead letters by id across runs; *n is how many dead
 * letters there are (above max: grow and run again).
 */
static bool
run_retry(InboxSubscription *sub, int64 *ids, Verdict *verdicts, int max,
		  int *n, Failure *failure)
{
	MemoryContext cxt = CurrentMemoryContext;
	volatile int current = -1;
	volatile bool committed = false;

	PG_TRY();
	{
		HeldKeys	held = {0};
		InboxEvent *events;
		int			count;
		int			i;

		inbox_run_begin(sub);
		/* the retried ones hold their keys only by what fails in this run */
		sub->has_dead = false;
		count = inbox_dead_load_retry(sub->name, &events);
		*n = count;
		if (count > max)
			elog(ERROR, "outbox inbox: more dead letters than expected");
		for (i = 0; i < count; i++)
		{
			if (ids[i] != events[i].dead_id)
			{
				ids[i] = events[i].dead_id;
				memset(&verdicts[i], 0, sizeof(Verdict));
			}
			current = i;
			(void) settle(sub, &events[i], &verdicts[i], &held);
			current = -1;
		}
		inbox_run_end();
		committed = true;
	}
	PG_CATCH();
	{
		inbox_run_catch(failure, &current, cxt);
	}
	PG_END_TRY();
	MemoryContextSwitchTo(cxt);
	return committed;
}

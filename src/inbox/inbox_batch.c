/*-------------------------------------------------------------------------
 *
 * inbox_batch.c
 *	  One run of a Kafka batch in one transaction, settled set-based: the
 *	  work per batch, not per event.
 *
 * A run goes in passes over the batch's records (inbox_apply.c says what
 * happens to each and how a failed run is run again):
 *	1. decode each record once (the partition's records below its
 *	   next_offset, or of a stalled partition, are skipped);
 *	2. probe the seen ids of the whole batch, both slots, with one
 *	   statement;
 *	3. decide each record's fate in offset order, in memory: failed in an
 *	   earlier run (a dead letter), its key held (a held dead letter), a
 *	   duplicate (seen, or earlier in this batch), or to be applied;
 *	4. record the ids to be applied with one INSERT ... ON CONFLICT DO
 *	   NOTHING: an id another transaction recorded first is a duplicate
 *	   (the index made this one wait for it);
 *	5. apply: a per-event handler called once per record, all inside one
 *	   switch to the subscription's role (inbox_handler.c); a batch handler
 *	   called once with the records in arrival order; in queue mode one
 *	   INSERT of them all.
 * Then the witness is checked (inbox_witness.c) and each partition's
 * offset advances by one compare-and-set.  Statements per batch: five
 * plus one per partition, plus one per dead letter written, whatever its
 * size; a per-event handler adds its own calls.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox_run.h"

#include "access/xact.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"

/* what pass 3 decided for a record */
typedef enum Fate
{
	FATE_SKIP,					/* not this run's: below the offset, stalled */
	FATE_APPLY,
	FATE_DUPLICATE,
	FATE_HELD,
	FATE_DEAD
} Fate;

/* a run's records, decoded */
typedef struct Run
{
	InboxSubscription *sub;
	rd_kafka_message_t **msgs;
	int			n;
	Verdict    *verdicts;
	InboxEvent *events;
	InboxPartition **parts;
	Fate	   *fates;
	bool	   *seen;
} Run;

static void decode(Run *run);
static void probe_seen(Run *run);
static void decide(Run *run);
static void record_ids(Run *run);
static void apply(Run *run, volatile int *current);
static void tally(Run *run, Tally *tallies);

/*
 * inbox_run_kafka_batch
 *		One run of msgs[0..n-1] in one transaction: true if it committed
 *		(then tallies say what it did per partition), false with *failure
 *		set if it rolled back: failure->index is the record whose handler
 *		failed, INBOX_RUN_WHOLE_BATCH when a batch handler's call or the
 *		queue insert failed, -1 for an error that is no record's;
 *		failure->recreated when a partition stalled because its topic was
 *		re-created (run again: its records are left out now).
 */
bool
inbox_run_kafka_batch(InboxSubscription *sub, rd_kafka_message_t **msgs,
					  int n, Verdict *verdicts, Tally *tallies,
					  Failure *failure)
{
	MemoryContext cxt = CurrentMemoryContext;
	volatile int current = -1;
	volatile bool committed = false;
	volatile bool recreated = false;

	PG_TRY();
	{
		Run			run;
		int			i;

		memset(&run, 0, sizeof(run));
		run.sub = sub;
		run.msgs = msgs;
		run.n = n;
		run.verdicts = verdicts;
		inbox_witness_request(sub, msgs, n);
		inbox_run_begin(sub);
		decode(&run);
		probe_seen(&run);
		decide(&run);
		record_ids(&run);
		apply(&run, &current);
		tally(&run, tallies);
		if (!inbox_witness_verify(sub))
		{
			recreated = true;
			AbortCurrentTransaction();
		}
		else
		{
			for (i = 0; i < sub->npartitions; i++)
				if (tallies[i].touched)
					inbox_offsets_advance(sub, &sub->partitions[i], tallies[i].last + 1,
										  tallies[i].last_hash, tallies[i].applied,
										  tallies[i].duplicates);
			inbox_run_end();
			committed = true;
		}
	}
	PG_CATCH();
	{
		inbox_run_catch(failure, &current, cxt);
	}
	PG_END_TRY();
	MemoryContextSwitchTo(cxt);
	failure->recreated = recreated;
	return committed;
}

/* pass 1: each record of this run decoded once */
static void
decode(Run *run)
{
	int			i;

	run->events = palloc0(sizeof(InboxEvent) * run->n);
	run->parts = palloc0(sizeof(InboxPartition *) * run->n);
	run->fates = palloc0(sizeof(Fate) * run->n);
	run->seen = palloc0(sizeof(bool) * run->n);
	for (i = 0; i < run->n; i++)
	{
		rd_kafka_message_t *m = run->msgs[i];
		InboxPartition *p = inbox_find_partition(run->sub, rd_kafka_topic_name(m->rkt),
												 m->partition);

		/*
		 * not ours any more, applied already (before a seek back), or
		 * stalled (its topic was re-created)
		 */
		run->fates[i] = FATE_SKIP;
		if (p == NULL || p->stalled || (p->next_offset >= 0 && m->offset < p->next_offset))
			continue;
		run->parts[i] = p;
		run->fates[i] = FATE_APPLY;
		inbox_event_from_message(&run->events[i], m);
	}
}

/* pass 2: which ids of the run were applied within the window */
static void
probe_seen(Run *run)
{
	pg_uuid_t  *ids;
	int		   *at;
	bool	   *seen;
	int			n = 0;
	int			i;

	if (!run->sub->dedupe)
		return;
	ids = palloc(sizeof(pg_uuid_t) * run->n);
	at = palloc(sizeof(int) * run->n);
	for (i = 0; i < run->n; i++)
		if (run->fates[i] != FATE_SKIP && run->events[i].has_event_id)
		{
			ids[n] = run->events[i].event_id;
			at[n++] = i;
		}
	seen = palloc(sizeof(bool) * Max(n, 1));
	inbox_dedupe_seen_many(run->sub->name, ids, n, seen);
	for (i = 0; i < n; i++)
		run->seen[at[i]] = seen[i];
}

/*
 * pass 3: each record's fate, in offset order (a held key holds the later
 * records of the key, an id applies once per batch); dead letters are
 * written here
 */
static void
decide(Run *run)
{
	InboxSubscription *sub = run->sub;
	HeldKeys	held = {0};
	HASHCTL		ctl;
	HTAB	   *ids = NULL;
	int			i;

	if (sub->dedupe)
	{
		memset(&ctl, 0, sizeof(ctl));
		ctl.keysize = sizeof(pg_uuid_t);
		ctl.entrysize = sizeof(pg_uuid_t);
		ctl.hcxt = CurrentMemoryContext;
		ids = hash_create("outbox inbox batch ids", Max(run->n, 16), &ctl,
						  HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	for (i = 0; i < run->n; i++)
	{
		InboxEvent *ev = &run->events[i];
		Verdict    *v = &run->verdicts[i];
		bool		dedupe = sub->dedupe && ev->has_event_id;
		bool		copy = false;

		if (run->fates[i] == FATE_SKIP)
			continue;
		if (dedupe)
			copy = run->seen[i] || hash_search(ids, &ev->event_id, HASH_FIND, NULL) != NULL;
		if (v->failed || (sub->hold && ev->key != NULL &&
						  (inbox_held_here(&held, ev) ||
						   (sub->has_dead && inbox_key_held(sub->name, ev)))))
		{
			if (copy)
			{
				run->fates[i] = FATE_DUPLICATE;
				continue;
			}
			if (sub->hold)
				inbox_hold_key(&held, ev);
			if (v->failed)
				inbox_dead_insert(sub->name, ev, false, v->error, v->sqlstate, v->attempts);
			else
				inbox_dead_insert(sub->name, ev, true, NULL, NULL, 0);
			run->fates[i] = v->failed ? FATE_DEAD : FATE_HELD;
			continue;
		}
		if (copy)
		{
			run->fates[i] = FATE_DUPLICATE;
			continue;
		}
		if (dedupe)
			(void) hash_search(ids, &ev->event_id, HASH_ENTER, NULL);
	}
}

/* pass 4: the ids to apply recorded; one some other transaction has is a copy */
static void
record_ids(Run *run)
{
	pg_uuid_t  *ids;
	int		   *at;
	bool	   *recorded;
	int			n = 0;
	int			i;

	if (!run->sub->dedupe)
		return;
	ids = palloc(sizeof(pg_uuid_t) * run->n);
	at = palloc(sizeof(int) * run->n);
	for (i = 0; i < run->n; i++)
		if (run->fates[i] == FATE_APPLY && run->events[i].has_event_id)
		{
			ids[n] = run->events[i].event_id;
			at[n++] = i;
		}
	recorded = palloc(sizeof(bool) * Max(n, 1));
	inbox_dedupe_record_many(run->sub->name, ids, n, recorded);
	for (i = 0; i < n; i++)
		if (!recorded[i])
			run->fates[at[i]] = FATE_DUPLICATE;
}

/*
 * pass 5: apply the records to apply; *current says which one a failure
 * belongs to
 */
static void
apply(Run *run, volatile int *current)
{
	InboxSubscription *sub = run->sub;
	InboxEvent **evs = palloc(sizeof(InboxEvent *) * run->n);
	int			n = 0;
	int			i;

	for (i = 0; i < run->n; i++)
		if (run->fates[i] == FATE_APPLY)
			evs[n++] = &run->events[i];
	if (n == 0)
		return;
	if (sub->handler_text == NULL)
	{
		*current = INBOX_RUN_WHOLE_BATCH;
		inbox_queue_batch(sub, evs, n);
		*current = -1;
		return;
	}
	inbox_handler_enter(sub);
	if (sub->batch_handler)
	{
		*current = INBOX_RUN_WHOLE_BATCH;
		inbox_handler_call_batch(sub, evs, n);
	}
	else
		for (i = 0; i < run->n; i++)
		{
			if (run->fates[i] != FATE_APPLY)
				continue;
			*current = i;
			inbox_handler_call(sub, &run->events[i]);
		}
	*current = -1;
	inbox_handler_leave();
}

/* what the run did to each partition */
static void
tally(Run *run, Tally *tallies)
{
	int			i;

	for (i = 0; i < run->n; i++)
	{
		Tally	   *t;

		if (run->fates[i] == FATE_SKIP)
			continue;
		t = &tallies[run->parts[i] - run->sub->partitions];
		t->touched = true;
		t->last = run->msgs[i]->offset;
		t->last_hash = inbox_witness_hash(run->msgs[i]);
		t->applied += run->fates[i] == FATE_APPLY;
		t->duplicates += run->fates[i] == FATE_DUPLICATE;
	}
}

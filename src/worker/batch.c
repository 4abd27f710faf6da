/*-------------------------------------------------------------------------
 *
 * batch.c
 *	  One relay transaction: lock outbox.events, check pause and permission,
 *	  claim committed events (or, relay v2, take the next snapshot batch),
 *	  produce them (message.c), wait for every delivery report, and mark
 *	  what Kafka acknowledged (mark.c).  One call = one transaction of the
 *	  relay worker.
 *
 * Why this is at-least-once:
 *	- Rows are claimed in id order with FOR UPDATE SKIP LOCKED, and only
 *	  committed rows are visible, so a rolled-back event is never read.
 *	- A row is marked published only after its delivery report said Kafka
 *	  acknowledged it (acks=all), in the same transaction that claimed it.
 *	  A crash before that commit leaves the row unpublished; it is sent
 *	  again, and consumers drop the duplicate by its "id" header.
 *	- A row whose delivery failed keeps published_at NULL and gets
 *	  attempts + 1, last_error and a backoff (mark.c).
 * How per-aggregate order is kept is written down once, in message.c.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "worker/batch.h"
#include "config/guc.h"
#include "exactly_once/exactly_once.h"
#include "kafka/producer.h"
#include "relay/claim.h"
#include "relay/fault_point.h"
#include "relay/mark.h"
#include "relay/message.h"
#include "relay/relay.h"
#include "relay/relay_xact.h"
#include "relay/snapshot.h"
#include "shared/partition.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "utils/acl.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"

/*
 * The last claim of row-tracked events found nothing it could send (all
 * held back): the next call turns to the snapshot batch, so that held rows
 * never starve it.
 */
static bool rows_claimed_nothing = false;

/* saved plans, prepared on first use in this worker */
static SPIPlanPtr paused_plan = NULL;

static void begin_batch(OutboxProducer *producer, Batch *batch);
static bool relay_is_paused(Oid events_relid);
static void check_can_delete(Oid events_relid);
static bool relay_rows_first(void);
static void relay_claimed_rows(OutboxProducer *producer, Batch *batch,
							   Portal portal, bool dead_letters,
							   OutboxBatchResult *result);
static void relay_snapshot_batch(OutboxProducer *producer, Batch *batch,
								 bool bytes, OutboxBatchResult *result);
static void produce_snapshot_chunks(OutboxProducer *producer, Batch *batch,
									OutboxSnapshotBatch *sb);
static int	snapshot_verdicts(OutboxProducer *producer, Batch *batch,
							  Datum *demote, int *ndemote);
static void wait_for_reports(OutboxProducer *producer,
							 OutboxBatchResult *result);
static void mark_batch(OutboxProducer *producer, BatchEntry *entries, int n,
					   bool dead_letters, bool by_snapshot,
					   OutboxBatchResult *result);
static void end_rows_transaction(OutboxProducer *producer, Batch *batch,
								 OutboxBatchResult *result);
static bool all_acknowledged(OutboxProducer *producer, Batch *batch);
static void end_snapshot_transaction(OutboxProducer *producer, Batch *batch,
									 OutboxSnapshotBatch *sb, Datum *demote,
									 int ndemote, OutboxBatchResult *result);

/*
 * outbox_relay_batch
 *		Run one relay transaction: claim up to outbox.batch_size committed,
 *		unpublished events in id order, produce them, wait for every
 *		delivery report, and mark the acknowledged ones published (or
 *		deleted, with outbox.retention = 0) and the failed ones for retry.
 *
 * Fills *result.  When outbox.events does not exist (extension not created
 * yet, or dropped) it sets result->table_missing and touches nothing: the
 * caller waits and looks again.  Other errors (SPI) are raised as ERROR and
 * handled by the worker's error recovery.
 */
void
outbox_relay_batch(OutboxProducer *producer, OutboxBatchResult *result)
{
	Batch		batch;
	MemoryContext callercxt;
	Oid			relid;
	ClaimVariant variant;
	bool		snapshot_schema;
	bool		bytes;
	Portal		portal;

	memset(result, 0, sizeof(*result));
	callercxt = outbox_relay_xact_begin("outbox relay: claiming events");
	result->cxt = callercxt;

	relid = outbox_lock_events_table();
	if (!OidIsValid(relid))
	{
		result->table_missing = true;
		outbox_relay_xact_end(callercxt, false);
		return;
	}
	begin_batch(producer, &batch);
	batch.events_relid = relid;
	if (relay_is_paused(relid))
	{
		result->paused = true;
		outbox_relay_xact_end(callercxt, false);
		return;
	}
	check_can_delete(relid);
	variant = outbox_claim_variant(relid);
	snapshot_schema = outbox_snapshot_schema(relid);
	bytes = outbox_bytes_schema(relid);
	/* of k relays, worker 0 runs the snapshot batches, for every bucket */
	if (snapshot_schema && outbox_relay_serves_all() && !relay_rows_first())
	{
		if (!outbox_rows_for_new_events() || outbox_snapshot_events_exist())
			relay_snapshot_batch(producer, &batch, bytes, result);
		outbox_relay_xact_end(callercxt, true);
		return;
	}
	/* a test hook: the transaction's snapshot is taken, nothing claimed yet */
	outbox_fault_point("claim_start");
	portal = outbox_open_claim(variant, snapshot_schema, bytes);
	if (relay_is_paused(relid))
	{
		/* paused after the first check: see relay_is_paused */
		SPI_cursor_close(portal);
		result->paused = true;
		outbox_relay_xact_end(callercxt, false);
		return;
	}

	/*
	 * From here to the commit, SIGTERM (a fast or smart shutdown, a restart)
	 * must not end the process mid-batch: what Kafka acknowledged would stay
	 * unmarked and be sent again after the restart.  So interrupts are held;
	 * on SIGTERM producing stops, the waits end at once (ProcDiePending is
	 * checked in them), the acknowledged events are marked, and the worker
	 * exits right after the commit.  Nothing in between waits for a lock:
	 * the claim skips locked rows, the marks touch only rows it locked.
	 * What else must not wait for the batch is served in the waits by hand:
	 * the procsignal barriers that DROP DATABASE and others wait for
	 * (absorb_barriers).
	 */
	HOLD_INTERRUPTS();
	relay_claimed_rows(producer, &batch, portal, variant != CLAIM_V10, result);
	outbox_relay_xact_end(callercxt, true);
	RESUME_INTERRUPTS();

	/*
	 * From 1.4 on, rows are claimed only when one is due: an empty claim
	 * means they all wait behind a failed event, and the snapshot batch is
	 * next (an empty claim before 1.4 is just an empty table).  Of k relays
	 * only worker 0 runs snapshot batches; the others' claims always run,
	 * and an empty one just means nothing of theirs is due.
	 */
	result->rows_held = snapshot_schema && batch.n == 0 && outbox_relay_serves_all();
}

/*
 * Start an empty batch of up to outbox.batch_size rows in the current
 * memory context, and the producer's delivery slots for it.
 */
static void
begin_batch(OutboxProducer *producer, Batch *batch)
{
	batch->entries = palloc0(sizeof(BatchEntry) * outbox_batch_size);
	batch->n = 0;
	batch->blocked = NULL;
	batch->no_isolation = false;
	batch->cxt = CurrentMemoryContext;
	batch->held = NULL;
	/* one more: exactly_once adds the progress record */
	outbox_producer_begin_batch(producer, outbox_batch_size + 1);
}

/*
 * True if outbox.pause() paused the relay.  Schemas before 1.2 have no
 * outbox.relay table and cannot be paused.
 *
 * Read with a snapshot of its own (read_only = false), and once more right
 * after the batch's own snapshot was taken (the claim's cursor, or the
 * snapshot batch's pg_current_snapshot()): a pause() that committed before
 * that snapshot is then seen, and events emitted after pause() returned
 * are never in the batch.  The first read alone left a window in which a
 * batch that had just read "not paused" sent them.
 */
static bool
relay_is_paused(Oid events_relid)
{
	bool		isnull;
	Datum		paused;

	if (!OidIsValid(get_relname_relid("relay", get_rel_namespace(events_relid))))
		return false;
	if (SPI_execute_plan(outbox_prepare_plan(&paused_plan, "SELECT paused FROM outbox.relay",
											 0, NULL), NULL, NULL, false, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read outbox.relay");
	if (SPI_processed == 0)
		return false;
	paused = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return !isnull && DatumGetBool(paused);
}

/*
 * With outbox.retention = 0 an acknowledged event is deleted, not marked.
 * A role without DELETE would have every batch sent, then fail to delete
 * it, and send it again after the backoff, over and over: refuse before
 * anything is sent.  (UPDATE needs no such check: the claim's FOR UPDATE
 * fails on its own before a message is produced.)
 */
static void
check_can_delete(Oid events_relid)
{
	if (outbox_retention != 0 ||
		pg_class_aclcheck(events_relid, GetUserId(), ACL_DELETE) == ACLCHECK_OK)
		return;
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("permission denied for table events"),
			 errdetail("With outbox.retention = 0 the relay deletes each event once Kafka acknowledged it, so its role \"%s\" needs DELETE on outbox.events. Nothing was sent.",
					   GetUserNameFromId(GetUserId(), false)),
			 errhint("GRANT DELETE ON outbox.events to the relay's role, or set outbox.retention to a positive interval or -1.")));
}

/*
 * Should this call claim row-tracked events (schema 1.4)?  Yes when one is
 * due, unless the last such claim found nothing it could send.
 */
static bool
relay_rows_first(void)
{
	bool		rows = !rows_claimed_nothing && outbox_rows_due();

	rows_claimed_nothing = false;
	return rows;
}

/*
 * Produce the rows of the claim cursor, wait for their reports, and mark
 * them.  Interrupts are held by the caller.
 */
static void
relay_claimed_rows(OutboxProducer *producer, Batch *batch, Portal portal,
				   bool dead_letters, OutboxBatchResult *result)
{
	MemoryContext rowcxt = AllocSetContextCreate(CurrentMemoryContext,
												 "outbox relay row",
												 ALLOCSET_DEFAULT_SIZES);

	bool		eos = producer->transactional_id != NULL;
	int			fetched;

	if (eos && !outbox_eos_begin(producer, result))
		return;

	/*
	 * However the fetch stopped, only the rows it fetched are marked, each by
	 * its own delivery report: the rest stays unpublished and is claimed again.
	 */
	(void) outbox_fetch_and_produce(producer, batch, portal, rowcxt, &fetched);
	result->claimed = batch->n;
	rows_claimed_nothing = (batch->n == 0);

	if (eos && batch->n > 0)
		(void) outbox_eos_add_record(producer,
									 outbox_eos_rows_record(batch),
									 batch->n);
	outbox_fault_point("after_produce");
	if (batch->n > 0)
		wait_for_reports(producer, result);
	outbox_fault_point("after_ack");
	if (eos)
		end_rows_transaction(producer, batch, result);
	if (batch->n > 0)
		mark_batch(producer, batch->entries, batch->n, dead_letters, false,
				   result);
	result->fatal = producer->fatal;
	outbox_fault_point("before_commit");
}

/*
 * exactly_once: commit the claimed rows' transaction with their ids as the
 * progress record if Kafka acknowledged every one of them; else abort it,
 * and let mark_batch() record only the events Kafka refused for good
 * (outbox_eos_keep_refusals).  An abort over refusals alone is planned: the
 * broker is not down.
 */
static void
end_rows_transaction(OutboxProducer *producer, Batch *batch,
					 OutboxBatchResult *result)
{
	bool		waits_aborted = result->aborted;
	bool		transient;
	int			refused;

	if (batch->n == 0)
	{
		outbox_eos_abort(producer, result);
		result->aborted = false;
		return;
	}
	if (all_acknowledged(producer, batch) &&
		outbox_eos_commit(producer, batch->n, result))
		return;
	if (!result->aborted)
		outbox_eos_abort(producer, result);
	refused = outbox_eos_keep_refusals(producer, batch->entries, batch->n,
									   &transient);
	result->aborted = waits_aborted || transient || producer->fatal || refused == 0;
}

/*
 * True if Kafka acknowledged every event of the batch that was produced,
 * so that its transaction may be committed.  Events held back (behind a
 * large or retried event of their aggregate, or a row-tracked one) were
 * not produced on purpose and are not part of the transaction.
 */
static bool
all_acknowledged(OutboxProducer *producer, Batch *batch)
{
	if (producer->fatal)
		return false;
	for (int i = 0; i < batch->n; i++)
	{
		if (batch->entries[i].held_back)
			continue;
		if (!batch->entries[i].produced || !producer->deliveries[i].reported ||
			producer->deliveries[i].err != RD_KAFKA_RESP_ERR_NO_ERROR)
			return false;
	}
	return true;
}

/*
 * Relay v2 (schema 1.4): produce the next chunk of the snapshot batch (see
 * snapshot.c) and, when Kafka acknowledged all of it, record the progress.
 * No event row is locked or written.  PROTOTYPE: any failure leaves the
 * progress where it was, and the whole chunk is sent again after the
 * backoff (dead letters and hold/skip are not done yet).
 */
static void
relay_snapshot_batch(OutboxProducer *producer, Batch *batch, bool bytes,
					 OutboxBatchResult *result)
{
	OutboxSnapshotBatch sb;
	Datum	   *demote = palloc(sizeof(Datum) * outbox_batch_size);
	int			ndemote = 0;
	int			verdicts;

	/* a test hook: the transaction's snapshot is taken, cur is not yet */
	outbox_fault_point("snapshot_start");
	outbox_snapshot_adopt();
	outbox_snapshot_begin(&sb);
	if (relay_is_paused(batch->events_relid))
	{
		/* paused after the first check: see relay_is_paused */
		result->paused = true;
		return;
	}
	sb.bytes = bytes;
	batch->held = outbox_snapshot_held();
	HOLD_INTERRUPTS();
	if (producer->transactional_id != NULL &&
		!outbox_eos_begin(producer, result))
	{
		RESUME_INTERRUPTS();
		return;
	}
	produce_snapshot_chunks(producer, batch, &sb);
	result->claimed = batch->n;

	if (producer->transactional_id != NULL && batch->n > 0)
	{
		/* the record says what the database will say if all goes out */
		sb.from = batch->entries[batch->n - 1].id;
		(void) outbox_eos_add_record(producer,
									 outbox_eos_snapshot_record(&sb, batch),
									 batch->n);
	}
	outbox_fault_point("after_produce");
	if (batch->n > 0)
		wait_for_reports(producer, result);
	outbox_fault_point("after_ack");
	verdicts = snapshot_verdicts(producer, batch, demote, &ndemote);
	if (verdicts < batch->n)
		sb.exhausted = false;
	if (producer->transactional_id != NULL)
		end_snapshot_transaction(producer, batch, &sb, demote, ndemote, result);
	else
	{
		if (verdicts > 0)
		{
			outbox_snapshot_demote(demote, ndemote);
			mark_batch(producer, batch->entries, verdicts, true, true, result);
			sb.from = batch->entries[verdicts - 1].id;
		}
		if (verdicts > 0 || sb.exhausted)
			outbox_snapshot_save(&sb);
	}
	result->fatal = producer->fatal;
	outbox_fault_point("before_commit");
	RESUME_INTERRUPTS();
}

/*
 * exactly_once: commit the snapshot batch's transaction with its progress
 * record if Kafka acknowledged every event, then record the progress in
 * the database.  Else abort it; the events refused for good, and those
 * held back behind a row-tracked event, are handed over to row tracking
 * (which sends them again, alone, and records their failures), and the
 * progress stays where it was.  A batch without events writes nothing to
 * Kafka: the database's progress may then move ahead of the last record,
 * which the start allows (exactly_once.c).
 */
static void
end_snapshot_transaction(OutboxProducer *producer, Batch *batch,
						 OutboxSnapshotBatch *sb, Datum *demote, int ndemote,
						 OutboxBatchResult *result)
{
	bool		waits_aborted;
	bool		transient;

	if (batch->n == 0)
	{
		outbox_eos_abort(producer, result);
		result->aborted = false;
		if (sb->exhausted)
			outbox_snapshot_save(sb);
		return;
	}
	if (all_acknowledged(producer, batch))
	{
		if (outbox_eos_commit(producer, batch->n, result))
		{
			/*
			 * Every produced event was acknowledged, so snapshot_verdicts()
			 * put exactly the held-back ones into demote: they go to row
			 * tracking, as the record says.
			 */
			outbox_snapshot_demote(demote, ndemote);
			mark_batch(producer, batch->entries, batch->n, true, true, result);
			outbox_snapshot_save(sb);
		}
		return;
	}
	waits_aborted = result->aborted;
	outbox_eos_abort(producer, result);
	(void) outbox_eos_keep_refusals(producer, batch->entries, batch->n,
									&transient);
	/* after the abort, every refused or held-back event goes, not a prefix */
	ndemote = 0;
	for (int i = 0; i < batch->n; i++)
	{
		BatchEntry *e = &batch->entries[i];

		if (e->held_back || outbox_delivery_failed(e, &producer->deliveries[i]))
			demote[ndemote++] = Int64GetDatum(e->id);
		if (!e->held_back && outbox_delivery_failed(e, &producer->deliveries[i]) &&
			result->first_error == NULL)
			result->first_error = MemoryContextStrdup(result->cxt, e->produced ?
													  rd_kafka_err2str(producer->deliveries[i].err) :
													  e->error_text);
	}
	/* an abort over refusals or held-back events alone is planned */
	result->aborted = waits_aborted || transient || producer->fatal || ndemote == 0;
	/* handed over without a mark: row tracking counts their failures */
	outbox_snapshot_demote(demote, ndemote);
}

/*
 * Produce the snapshot batch sb, part A then part B, until the batch is
 * full or both parts returned their last rows.
 *
 * A part is done only when its cursor ran dry short of its limit.  A fetch
 * cut short by SIGTERM or a fatal producer error says nothing about the
 * rows after it: were sb->exhausted set then, outbox_snapshot_save() would
 * record the whole batch's snapshot as published, unsent rest included.
 */
static void
produce_snapshot_chunks(OutboxProducer *producer, Batch *batch,
						OutboxSnapshotBatch *sb)
{
	MemoryContext rowcxt;
	bool		part_b = false;
	int			limit;
	int			got;
	OutboxFetchStop stop = OUTBOX_FETCH_DRY;

	rowcxt = AllocSetContextCreate(CurrentMemoryContext, "outbox relay row",
								   ALLOCSET_DEFAULT_SIZES);
	while (stop == OUTBOX_FETCH_DRY && batch->n < outbox_batch_size &&
		   !sb->exhausted)
	{
		limit = outbox_batch_size - batch->n;
		stop = outbox_fetch_and_produce(producer, batch,
										outbox_snapshot_open(sb, limit, &part_b),
										rowcxt, &got);
		if (stop != OUTBOX_FETCH_DRY || got >= limit)
			continue;			/* cut short, or the part may hold more */
		if (part_b)
			sb->exhausted = true;
		else
			sb->part_a_done = true;
	}
}

/*
 * The progress may only cover a prefix of the batch in which every event
 * has a verdict: acknowledged, or failed (or held back) and handed over
 * to row tracking.  From the first event without a verdict (aborted
 * waits, a fatal error, shutdown) on, the chunk is sent again.
 *
 * snapshot_verdicts returns the length of that prefix, and puts the ids of
 * its failed and held-back events into demote[*ndemote].
 */
static int
snapshot_verdicts(OutboxProducer *producer, Batch *batch, Datum *demote,
				  int *ndemote)
{
	int			i;

	for (i = 0; i < batch->n; i++)
	{
		BatchEntry *e = &batch->entries[i];
		OutboxDelivery *d = &producer->deliveries[i];

		if (e->produced && d->reported && d->err == RD_KAFKA_RESP_ERR_NO_ERROR)
			continue;
		if (e->held_back || outbox_delivery_failed(e, d))
		{
			demote[(*ndemote)++] = Int64GetDatum(e->id);
			continue;
		}
		break;
	}
	return i;
}

/*
 * Wait for the delivery reports of the batch; if they do not all come,
 * keep what was acknowledged and give up on the rest for now.
 */
static void
wait_for_reports(OutboxProducer *producer, OutboxBatchResult *result)
{
	pgstat_report_activity(STATE_RUNNING,
						   "outbox relay: waiting for delivery reports");
	if (!outbox_wait_for_deliveries(producer))
	{
		/* keep what was acknowledged, give up on the rest for now */
		outbox_producer_abort_batch(producer);
		result->aborted = true;
	}
}

/*
 * Mark entries[0..n-1] (mark.c) and add what that did to *result.
 */
static void
mark_batch(OutboxProducer *producer, BatchEntry *entries, int n,
		   bool dead_letters, bool by_snapshot, OutboxBatchResult *result)
{
	MarkCounts	counts;

	memset(&counts, 0, sizeof(counts));
	counts.cxt = result->cxt;
	outbox_mark_results(producer, entries, n, dead_letters, by_snapshot,
						&counts);
	result->published += counts.published;
	result->failed_permanent += counts.failed_permanent;
	result->failed_transient += counts.failed_transient;
	result->failed_unattributed += counts.failed_unattributed;
	result->dead_lettered += counts.dead_lettered;
	result->held_back += counts.held_back;
	result->overtaken += counts.overtaken;
	if (result->first_error == NULL)
		result->first_error = counts.first_error;
}

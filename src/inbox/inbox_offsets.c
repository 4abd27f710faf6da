/*-------------------------------------------------------------------------
 *
 * inbox_offsets.c
 *	  The Kafka offsets of the inbox, kept in outbox.inbox_offsets: the
 *	  database, not Kafka, is where consumption resumes from.
 *
 * Each (subscription, topic, partition) has a row whose next_offset is the
 * first record not yet applied.  The worker assigns its consumer from these
 * rows and advances a row in the transaction that applies the records,
 * with a compare-and-set: WHERE next_offset = the value the worker read.
 * If anything moved it in between (outbox.inbox_seek(), a second worker
 * after a restart of the launcher, a restore), the update finds no row,
 * the batch raises an error and rolls back with the handler's effects, and
 * the worker reads the offsets again.  So a record is applied at most once
 * per position, and at least once: a restart, a crash recovery, a
 * promotion or a point-in-time recovery reads the position from the same
 * state as the effects.
 *
 * next_offset may also be -2 (the partition's first offset) or -1 (its
 * end): new partitions start there, and the first batch replaces it with
 * the offset after its last record.  seek_time asks the worker to look up
 * an offset by time in Kafka (inbox_offsets_resolve_seeks).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

static SPIPlanPtr advance_plan = NULL;

static void resolve_ends(InboxSubscription *sub);

/*
 * inbox_find_partition
 *		sub's partition (topic, partition), or NULL.
 */
InboxPartition *
inbox_find_partition(InboxSubscription *sub, const char *topic, int32 partition)
{
	int			i;

	for (i = 0; i < sub->npartitions; i++)
		if (sub->partitions[i].partition == partition &&
			strcmp(sub->partitions[i].topic, topic) == 0)
			return &sub->partitions[i];
	return NULL;
}

/*
 * inbox_add_partition
 *		Add (topic, partition) at next_offset to sub's list, in sub's memory
 *		context; returns it.  When it is in the calling worker's slice, its
 *		shared status entry is claimed; the others are listed only so that
 *		new ones are told from known ones.
 */
InboxPartition *
inbox_add_partition(InboxSubscription *sub, const char *topic, int32 partition,
					int64 next_offset)
{
	InboxPartition *p;

	if (sub->npartitions == sub->maxpartitions)
	{
		int			n = Max(16, sub->maxpartitions * 2);

		if (sub->partitions == NULL)
			sub->partitions = MemoryContextAllocZero(sub->cxt, sizeof(InboxPartition) * n);
		else
			sub->partitions = repalloc(sub->partitions, sizeof(InboxPartition) * n);
		sub->maxpartitions = n;
	}
	p = &sub->partitions[sub->npartitions++];
	memset(p, 0, sizeof(*p));
	p->topic = MemoryContextStrdup(sub->cxt, topic);
	p->partition = partition;
	p->next_offset = next_offset;
	p->witness_offset = -1;
	p->mine = inbox_partition_slice(topic, partition, sub->nslices) == sub->slice;
	p->status = p->mine ? inbox_status_claim(sub->name, topic, partition) : -1;
	return p;
}

/*
 * inbox_lock_subscription
 *		Lock sub's row of outbox.subscriptions FOR KEY SHARE for the rest of
 *		the transaction, before writing anything of the subscription:
 *		outbox.unsubscribe() deletes that row first, so it waits for this
 *		transaction and then sees all it wrote.  Raises ERROR (55000) when
 *		the subscription is gone.  Call with SPI connected.
 */
void
inbox_lock_subscription(InboxSubscription *sub)
{
	Datum		values[1];
	int			ret;

	values[0] = CStringGetTextDatum(sub->name);
	ret = SPI_execute_with_args("SELECT 1 FROM outbox.subscriptions WHERE name = $1 FOR KEY SHARE",
								1, (Oid[]) {TEXTOID}, values, NULL, false, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: locking a subscription failed: %s",
			 SPI_result_code_string(ret));
	if (SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("subscription \"%s\" was dropped", sub->name),
				 errhint("The inbox reads its subscriptions again.")));
}

/*
 * inbox_offsets_load
 *		Read sub's offsets rows into its partition list (which must be
 *		empty).  A row with a seek_time pending is left unassigned until
 *		inbox_offsets_resolve_seeks() resolved it.  Call in a transaction
 *		with SPI connected.
 */
void
inbox_offsets_load(InboxSubscription *sub)
{
	Datum		values[1];
	int			ret;
	uint64		i;

	values[0] = CStringGetTextDatum(sub->name);
	ret = SPI_execute_with_args("SELECT topic, kafka_partition, next_offset, seek_time IS NOT NULL,"
								"       witness_offset, witness_hash"
								"  FROM outbox.inbox_offsets WHERE subscription = $1"
								" ORDER BY topic, kafka_partition",
								1, (Oid[]) {TEXTOID}, values, NULL, true, 0);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: reading the offsets failed: %s",
			 SPI_result_code_string(ret));
	for (i = 0; i < SPI_processed; i++)
	{
		HeapTuple	row = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		bool		isnull;
		char	   *topic = TextDatumGetCString(SPI_getbinval(row, desc, 1, &isnull));
		int32		partition = DatumGetInt32(SPI_getbinval(row, desc, 2, &isnull));
		int64		next = DatumGetInt64(SPI_getbinval(row, desc, 3, &isnull));
		bool		seek = DatumGetBool(SPI_getbinval(row, desc, 4, &isnull));
		InboxPartition *p = inbox_add_partition(sub, topic, partition, next);
		Datum		w = SPI_getbinval(row, desc, 5, &isnull);

		p->seek_pending = seek;
		if (!isnull)
		{
			p->witness_offset = DatumGetInt64(w);
			p->witness_hash = (uint64) DatumGetInt64(SPI_getbinval(row, desc, 6, &isnull));
		}
	}
}

/*
 * inbox_offsets_insert
 *		A partition sub has no row for yet starts at next_offset (-2, -1 or
 *		an offset): insert its row, or keep the one another session made
 *		meanwhile, and add it to the list.  Call in a transaction with SPI
 *		connected.
 */
void
inbox_offsets_insert(InboxSubscription *sub, const char *topic, int32 partition,
					 int64 next_offset)
{
	Datum		values[4];
	int			ret;
	bool		isnull;

	values[0] = CStringGetTextDatum(sub->name);
	values[1] = CStringGetTextDatum(topic);
	values[2] = Int32GetDatum(partition);
	values[3] = Int64GetDatum(next_offset);
	ret = SPI_execute_with_args("INSERT INTO outbox.inbox_offsets AS o"
								" (subscription, topic, kafka_partition, next_offset)"
								" VALUES ($1, $2, $3, $4)"
								" ON CONFLICT (subscription, topic, kafka_partition)"
								" DO UPDATE SET next_offset = o.next_offset"
								" RETURNING o.next_offset",
								4, (Oid[]) {TEXTOID, TEXTOID, INT4OID, INT8OID},
								values, NULL, false, 1);
	if (ret != SPI_OK_INSERT_RETURNING || SPI_processed != 1)
		elog(ERROR, "outbox inbox: inserting an offset failed: %s",
			 SPI_result_code_string(ret));
	next_offset = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
											  SPI_tuptable->tupdesc, 1, &isnull));
	(void) inbox_add_partition(sub, topic, partition, next_offset);
}

/*
 * inbox_offsets_advance
 *		Compare-and-set part's row from the next_offset the worker holds to
 *		next_offset, with the witness of the record at next_offset - 1
 *		(its fingerprint witness_hash, inbox_witness.c), adding applied and
 *		duplicates to its counts, and end a
 *		crash attempt at a lower offset (inbox_attempts.c).  Raises ERROR
 *		(55000) when the row holds another value or is gone: the batch must
 *		roll back.  Call in the apply transaction; the caller updates
 *		part->next_offset after the commit.
 */
void
inbox_offsets_advance(InboxSubscription *sub, InboxPartition *part,
					  int64 next_offset, uint64 witness_hash, int64 applied,
					  int64 duplicates)
{
	Datum		values[8];
	int			ret;

	if (advance_plan == NULL)
	{
		Oid			types[8] = {TEXTOID, TEXTOID, INT4OID, INT8OID, INT8OID, INT8OID, INT8OID, INT8OID};

		advance_plan = SPI_prepare("UPDATE outbox.inbox_offsets"
								   "   SET next_offset = $5, applied = applied + $6,"
								   "       duplicates = duplicates + $7,"
								   "       witness_offset = $5 - 1, witness_hash = $8,"
								   "       attempts = CASE WHEN attempt_offset < $5 THEN 0 ELSE attempts END,"
								   "       attempt_offset = CASE WHEN attempt_offset < $5 THEN NULL ELSE attempt_offset END"
								   " WHERE subscription = $1 AND topic = $2 AND kafka_partition = $3"
								   "   AND next_offset = $4 AND seek_time IS NULL",
								   8, types);
		if (advance_plan == NULL || SPI_keepplan(advance_plan) != 0)
			elog(ERROR, "outbox inbox: could not prepare the offset update");
	}
	values[0] = CStringGetTextDatum(sub->name);
	values[1] = CStringGetTextDatum(part->topic);
	values[2] = Int32GetDatum(part->partition);
	values[3] = Int64GetDatum(part->next_offset);
	values[4] = Int64GetDatum(next_offset);
	values[5] = Int64GetDatum(applied);
	values[6] = Int64GetDatum(duplicates);
	values[7] = Int64GetDatum((int64) witness_hash);
	ret = SPI_execute_plan(advance_plan, values, NULL, false, 0);
	if (ret != SPI_OK_UPDATE)
		elog(ERROR, "outbox inbox: updating an offset failed: %s",
			 SPI_result_code_string(ret));
	if (SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the offset of subscription \"%s\", topic \"%s\", partition %d moved while a batch was applied",
						sub->name, part->topic, part->partition),
				 errdetail("The worker read next_offset %lld; a seek, an unsubscribe or another worker changed it.",
						   (long long) part->next_offset),
				 errhint("The batch is rolled back; the inbox reads the offsets again and goes on from them.")));
}

/*
 * inbox_offsets_resolve_seeks
 *		Move each partition of sub with a seek_time pending to the first
 *		offset at or after that time (Kafka's answer; its end when no record
 *		is that late), clearing seek_time in the same compare-and-set; then
 *		place the partitions that start at their first offset or their end
 *		(see resolve_ends).  A partition Kafka cannot answer for now stays
 *		as it is.  Call in a transaction with SPI connected, with sub's
 *		consumer built.
 */
void
inbox_offsets_resolve_seeks(InboxSubscription *sub)
{
	Datum		values[1];
	int			ret;
	uint64		i;
	uint64		n;
	SPITupleTable *rows;

	values[0] = CStringGetTextDatum(sub->name);
	ret = SPI_execute_with_args("SELECT topic, kafka_partition, seek_time FROM outbox.inbox_offsets"
								" WHERE subscription = $1 AND seek_time IS NOT NULL",
								1, (Oid[]) {TEXTOID}, values, NULL, false, 0);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: reading the seeks failed: %s",
			 SPI_result_code_string(ret));
	rows = SPI_tuptable;
	n = SPI_processed;
	for (i = 0; i < n; i++)
	{
		bool		isnull;
		char	   *topic = TextDatumGetCString(SPI_getbinval(rows->vals[i], rows->tupdesc, 1, &isnull));
		int32		partition = DatumGetInt32(SPI_getbinval(rows->vals[i], rows->tupdesc, 2, &isnull));
		TimestampTz when = DatumGetTimestampTz(SPI_getbinval(rows->vals[i], rows->tupdesc, 3, &isnull));
		InboxPartition *p = inbox_find_partition(sub, topic, partition);
		int64		offset;
		Datum		args[5];

		/* each partition is a request to Kafka: a stop waits for one only */
		CHECK_FOR_INTERRUPTS();
		if (p == NULL || !p->mine ||
			!inbox_consumer_resolve_time(sub, topic, partition, when, &offset))
			continue;
		if (offset == -1 && !inbox_consumer_resolve_end(sub, topic, partition, &offset))
			continue;
		args[0] = CStringGetTextDatum(sub->name);
		args[1] = CStringGetTextDatum(topic);
		args[2] = Int32GetDatum(partition);
		args[3] = TimestampTzGetDatum(when);
		args[4] = Int64GetDatum(offset);
		ret = SPI_execute_with_args("UPDATE outbox.inbox_offsets SET next_offset = $5, seek_time = NULL, witness_offset = NULL"
									" WHERE subscription = $1 AND topic = $2 AND kafka_partition = $3"
									"   AND seek_time = $4",
									5, (Oid[]) {TEXTOID, TEXTOID, INT4OID, TIMESTAMPTZOID, INT8OID},
									args, NULL, false, 0);
		if (ret != SPI_OK_UPDATE)
			elog(ERROR, "outbox inbox: resolving a seek failed: %s",
				 SPI_result_code_string(ret));
		if (SPI_processed == 1)
		{
			p->next_offset = offset;
			p->seek_pending = false;
			p->stalled = false;
		}
	}
	resolve_ends(sub);
}

/*
 * Replace a next_offset of -2 (the partition's first offset) or -1 (its end)
 * with the offset Kafka has there now, by compare-and-set, so that the
 * position is fixed when the worker takes it up (a record that comes after
 * a seek to the end is applied) and outbox.inbox_status shows it.  A
 * partition Kafka does not answer for keeps its -2 or -1: the consumer then
 * resolves it itself when it starts fetching.
 */
static void
resolve_ends(InboxSubscription *sub)
{
	int			i;

	for (i = 0; i < sub->npartitions; i++)
	{
		InboxPartition *p = &sub->partitions[i];
		int64		offset;
		Datum		args[5];
		int			ret;

		CHECK_FOR_INTERRUPTS();
		if (p->next_offset >= 0 || p->seek_pending || !p->mine ||
			!(p->next_offset == -1 ?
			  inbox_consumer_resolve_end(sub, p->topic, p->partition, &offset) :
			  inbox_consumer_resolve_start(sub, p->topic, p->partition, &offset)))
			continue;
		args[0] = CStringGetTextDatum(sub->name);
		args[1] = CStringGetTextDatum(p->topic);
		args[2] = Int32GetDatum(p->partition);
		args[3] = Int64GetDatum(p->next_offset);
		args[4] = Int64GetDatum(offset);
		ret = SPI_execute_with_args("UPDATE outbox.inbox_offsets SET next_offset = $5"
									" WHERE subscription = $1 AND topic = $2 AND kafka_partition = $3"
									"   AND next_offset = $4 AND seek_time IS NULL",
									5, (Oid[]) {TEXTOID, TEXTOID, INT4OID, INT8OID, INT8OID},
									args, NULL, false, 0);
		if (ret != SPI_OK_UPDATE)
			elog(ERROR, "outbox inbox: placing a partition failed: %s",
				 SPI_result_code_string(ret));
		if (SPI_processed == 1)
			p->next_offset = offset;
	}
}

/*
 * inbox_mark_started
 *		sub placed the partitions of its first start: from now on new ones
 *		begin at their first offset, whatever start_from says.  Call in a
 *		transaction with SPI connected.
 */
void
inbox_mark_started(InboxSubscription *sub)
{
	Datum		values[1];
	int			ret;

	values[0] = CStringGetTextDatum(sub->name);
	ret = SPI_execute_with_args("UPDATE outbox.subscriptions SET started = true WHERE name = $1",
								1, (Oid[]) {TEXTOID}, values, NULL, false, 0);
	if (ret != SPI_OK_UPDATE)
		elog(ERROR, "outbox inbox: marking a subscription started failed: %s",
			 SPI_result_code_string(ret));
	sub->started = true;
}

/*
 * inbox_offsets_forget_plans
 *		Drop the kept plan; prepared again at next use.
 */
void
inbox_offsets_forget_plans(void)
{
	if (advance_plan != NULL)
		SPI_freeplan(advance_plan);
	advance_plan = NULL;
}

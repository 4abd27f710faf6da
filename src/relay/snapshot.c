/*-------------------------------------------------------------------------
 *
 * snapshot.c
 *	  Relay v2: which events a batch holds, decided by commit snapshots.
 *
 * Every event records its writing (top-level) transaction in xid, and the
 * relay's progress is one row in outbox.relay: the snapshot up to which
 * everything is published, and the id floor read just before that snapshot
 * was taken.  The next batch is every event whose transaction is visible in
 * a newer snapshot "cur" and was not visible in the progress snapshot
 * "prev".  No event row is locked or updated for that.
 *
 * Those events are found through index scans, never from prev's xmin (a
 * transaction held open for hours would otherwise make every batch scan all
 * events written since it began):
 *	A. ids up to prev_floor: the transactions prev did not show as committed
 *	   (in its xip list, or at or above its xmax) and cur does, are listed
 *	   through events_xid_idx (xid, id), and their events read from it;
 *	B. ids above prev_floor: the primary key from prev_floor in id order,
 *	   keeping what is visible at cur and was not at prev.  An event above the
 *	   floor can only come from a transaction prev did not show: emit() gives
 *	   the transaction its xid before it takes an id from the sequence, and
 *	   prev_floor was read before prev was taken, so a transaction that got
 *	   its xid after prev took its ids after prev_floor.
 * All of A is below all of B, so the batch goes out in id order, and it can
 * be cut into chunks: batch_last_id records how far a batch got.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/snapshot.h"
#include "config/guc.h"
#include "relay/relay_xact.h"

#include "access/xlog.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

/* nothing is visible in it: every event is newer */
#define EMPTY_SNAPSHOT	"1:1:"

/* %s: e.payload_bytes from 1.6 on, else NULL::bytea (outbox_prepare_bytes_plan) */
#define EVENT_COLUMNS \
"SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type," \
"       e.topic, e.payload, e.headers, e.created_at, 0 AS attempts, %s, e.ctid" \
"  FROM outbox.events AS e"

/*
 * Part A: events with ids up to prev's floor whose transaction prev did not
 * show as committed: those running at prev (its xip list) and those whose
 * xid is prev's xmax or above.  (A snapshot leaves running transactions with
 * xids from xmax = latest completed + 1 on out of its xip list: such a
 * transaction may have had its xid, and taken ids below the floor, before
 * prev was taken.)  The transactions are listed first, through
 * events_xid_idx, then each one's events are read in id order from the
 * same index: never a scan of all events below the floor.  The listing has
 * no condition on id on purpose: with one ("id <= floor"), a table without
 * statistics yet (just created, not analyzed) got a plan that walked the
 * primary key below the floor in every batch.  Each transaction's events are
 * then read as the range (t.xid, $3) < (xid, id) <= (t.xid, $4) of
 * events_xid_idx, in its order: the same rows and order as "xid = t.xid AND
 * id > $3 AND id <= $4 ORDER BY id", but a condition and an order only that
 * index serves.  Written that way, a table whose events came from a few big
 * transactions (xid has one or two distinct values in the statistics, so
 * "xid = t.xid" looks like it matches every row) got a plan that walked the
 * primary key from $3 to $4 for each transaction: 300,000 entries a batch.
 */
static const char *const part_a_sql_format =
"SELECT e.* FROM ("
"       SELECT x FROM pg_catalog.pg_snapshot_xip($1::pg_catalog.pg_snapshot) AS x"
"        WHERE pg_catalog.pg_visible_in_snapshot(x, $2::pg_catalog.pg_snapshot)"
"       UNION"
"       SELECT l.xid FROM outbox.events AS l"
"        WHERE l.xid >= pg_catalog.pg_snapshot_xmax($1::pg_catalog.pg_snapshot)"
"          AND l.xid < pg_catalog.pg_snapshot_xmax($2::pg_catalog.pg_snapshot)"
"          AND pg_catalog.pg_visible_in_snapshot(l.xid, $2::pg_catalog.pg_snapshot)"
"       ) AS t(xid)"
" CROSS JOIN LATERAL ("
EVENT_COLUMNS
"        WHERE (e.xid, e.id) > (t.xid, $3) AND (e.xid, e.id) <= (t.xid, $4)"
"          AND e.xid IS NOT NULL"
"        ORDER BY e.xid, e.id LIMIT $5) AS e"
" ORDER BY e.id LIMIT $5";

/* part B: everything above prev's id floor, visible at cur but not at prev */
static const char *const part_b_sql_format =
EVENT_COLUMNS
" WHERE e.id > $3 AND e.xid IS NOT NULL"
"   AND NOT pg_catalog.pg_visible_in_snapshot(e.xid, $1::pg_catalog.pg_snapshot)"
"   AND pg_catalog.pg_visible_in_snapshot(e.xid, $2::pg_catalog.pg_snapshot)"
" ORDER BY e.id LIMIT $4";

static SPIPlanPtr progress_plan = NULL;
static SPIPlanPtr floor_plan = NULL;
static SPIPlanPtr current_plan = NULL;
static SPIPlanPtr part_a_plans[2];	/* [bytes] */
static SPIPlanPtr part_b_plans[2];
static SPIPlanPtr save_chunk_plan = NULL;
static SPIPlanPtr save_batch_plan = NULL;
static SPIPlanPtr legacy_plan = NULL;
static SPIPlanPtr exist_plan = NULL;
static SPIPlanPtr count_plan = NULL;
static SPIPlanPtr convert_plan = NULL;
static SPIPlanPtr reset_plan = NULL;
static SPIPlanPtr held_plan = NULL;
static SPIPlanPtr held_skip_plan = NULL;
static SPIPlanPtr demote_plan = NULL;
static SPIPlanPtr oldest_plan = NULL;

static void convert_restored_events(bool same_cluster, uint64 nrows);
static void reset_progress(Datum *args, Oid *types);

/* run a plan that returns one row of one column; NULL if SQL NULL */
static char *
single_value(SPIPlanPtr plan, Datum *args, bool read_only)
{
	if (SPI_execute_plan(plan, args, NULL, read_only, 1) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "outbox: relay progress query returned no row");
	return SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
}

/*
 * outbox_snapshot_schema
 *		True if outbox.events has the xid column (schema 1.4 and later).
 */
bool
outbox_snapshot_schema(Oid events_relid)
{
	return OidIsValid(get_relname_relid("relay_progress",
										get_rel_namespace(events_relid)));
}

/*
 * outbox_bytes_schema
 *		True if outbox.events has the payload_bytes column (schema 1.6 and
 *		later, emit_bytes()): the claims then read it (outbox_prepare_bytes_plan).
 */
bool
outbox_bytes_schema(Oid events_relid)
{
	return get_attnum(events_relid, "payload_bytes") != InvalidAttrNumber;
}

/*
 * outbox_rows_due
 *		True if an event tracked row by row can be sent now: not failed, not
 *		in its backoff.  The relay sends those first, the 1.3 way (batch.c).
 */
bool
outbox_rows_due(void)
{
	SPIPlanPtr	plan = outbox_prepare_plan(&legacy_plan,
								 "SELECT 1 FROM outbox.events"
								 " WHERE published_at IS NULL AND xid IS NULL"
								 "   AND failed_at IS NULL"
								 "   AND (next_attempt_at IS NULL OR next_attempt_at <= pg_catalog.now())"
								 " LIMIT 1",
								 0, NULL);

	if (SPI_execute_plan(plan, NULL, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "outbox: could not look for events due");
	return SPI_processed > 0;
}

/*
 * outbox_snapshot_begin
 *		Read the relay's progress and fix the batch: continue the one a
 *		previous transaction began, or start a new one at a fresh snapshot.
 *
 * The id floor is read before the snapshot is taken, each in a statement
 * of its own (READ COMMITTED: a new snapshot per statement); see the head
 * comment for why that order matters.
 */
void
outbox_snapshot_begin(OutboxSnapshotBatch *sb)
{
	char	   *v;

	memset(sb, 0, sizeof(*sb));
	if (SPI_execute_plan(outbox_prepare_plan(&progress_plan,
								   "SELECT snapshot::text, id_floor, batch_snapshot::text,"
								   "       batch_id_floor, batch_last_id FROM outbox.relay_progress",
								   0, NULL),
						 NULL, NULL, false, 1) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "outbox: outbox.relay_progress does not have one row");
	v = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
	sb->prev = v ? v : pstrdup(EMPTY_SNAPSHOT);
	sb->prev_floor = pg_strtoint64(SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2));
	v = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3);
	if (v != NULL)
	{
		sb->cur = v;
		sb->cur_floor = pg_strtoint64(SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 4));
		sb->from = pg_strtoint64(SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 5));
		sb->continued = true;
		sb->first_from = sb->from;
		return;
	}

	v = single_value(outbox_prepare_plan(&floor_plan,
							   "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END"
							   "  FROM outbox.events_id_seq", 0, NULL), NULL, false);
	sb->cur_floor = pg_strtoint64(v);
	sb->cur = single_value(outbox_prepare_plan(&current_plan,
									 "SELECT pg_catalog.pg_current_snapshot()::text",
									 0, NULL), NULL, false);
	sb->from = 0;
}

/*
 * outbox_snapshot_open
 *		Open a cursor over the next at most limit events of the batch, in id
 *		order: part A while ids below prev's floor are left, else part B.
 *		*part_b tells which one; B returning fewer than limit rows ends the
 *		batch.
 *
 * The cursor must read with a snapshot taken after cur (read_only =
 * false: a new one), or an event committed between the transaction's
 * first snapshot and cur would pass the visibility test on cur and still be
 * invisible to the scan, and the progress would pass over it.
 */
Portal
outbox_snapshot_open(OutboxSnapshotBatch *sb, int limit, bool *part_b)
{
	Oid			types[5] = {TEXTOID, TEXTOID, INT8OID, INT8OID, INT4OID};
	Datum		args[5];

	args[0] = CStringGetTextDatum(sb->prev);
	args[1] = CStringGetTextDatum(sb->cur);
	if (sb->from < sb->prev_floor && !sb->part_a_done)
	{
		*part_b = false;
		args[2] = Int64GetDatum(sb->from);
		args[3] = Int64GetDatum(sb->prev_floor);
		args[4] = Int32GetDatum(limit);
		return SPI_cursor_open(NULL,
							   outbox_prepare_bytes_plan(&part_a_plans[sb->bytes], part_a_sql_format,
										  sb->bytes, 5, types),
							   args, NULL, false);
	}
	*part_b = true;
	types[3] = INT4OID;
	args[2] = Int64GetDatum(Max(sb->from, sb->prev_floor));
	args[3] = Int32GetDatum(limit);
	return SPI_cursor_open(NULL,
						   outbox_prepare_bytes_plan(&part_b_plans[sb->bytes], part_b_sql_format,
									  sb->bytes, 4, types),
						   args, NULL, false);
}

/*
 * outbox_snapshot_save
 *		Record that every event of the batch up to sb->from is published;
 *		with sb->exhausted the whole batch is, and cur becomes the progress
 *		snapshot.  Runs in the relay's transaction, after Kafka acknowledged
 *		everything it records.
 */
void
outbox_snapshot_save(OutboxSnapshotBatch *sb)
{
	Oid			types[3] = {TEXTOID, INT8OID, INT8OID};
	Datum		args[3];
	int			ret;

	args[0] = CStringGetTextDatum(sb->cur);
	args[1] = Int64GetDatum(sb->cur_floor);
	args[2] = Int64GetDatum(sb->from);
	if (sb->exhausted)
	{
		if (strcmp(sb->cur, sb->prev) == 0 && sb->cur_floor == sb->prev_floor)
			return;				/* nothing moved */
		ret = SPI_execute_plan(outbox_prepare_plan(&save_batch_plan,
										 "UPDATE outbox.relay_progress SET snapshot = $1::pg_catalog.pg_snapshot,"
										 " id_floor = $2, batch_snapshot = NULL,"
										 " batch_id_floor = NULL, batch_last_id = NULL",
										 2, types),
							   args, NULL, false, 0);
	}
	else
		ret = SPI_execute_plan(outbox_prepare_plan(&save_chunk_plan,
										 "UPDATE outbox.relay_progress SET batch_snapshot = $1::pg_catalog.pg_snapshot,"
										 " batch_id_floor = $2, batch_last_id = $3",
										 3, types),
							   args, NULL, false, 0);
	if (ret != SPI_OK_UPDATE || SPI_processed != 1)
		elog(ERROR, "outbox: could not record the relay's progress");
}

/*
 * outbox_snapshot_events_exist
 *		True if any event is tracked by snapshot.  With outbox.relay_mode =
 *		row the relay looks at snapshots only while some are.
 */
bool
outbox_snapshot_events_exist(void)
{
	if (SPI_execute_plan(outbox_prepare_plan(&exist_plan,
								   "SELECT 1 FROM outbox.events WHERE xid IS NOT NULL LIMIT 1",
								   0, NULL),
						 NULL, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "outbox: could not look for events tracked by snapshot");
	return SPI_processed > 0;
}

/*
 * outbox_snapshot_adopt
 *		Make sure outbox.relay_progress holds exactly one row, written in
 *		this cluster, before the progress is used.
 *
 * Two cases leave something else there.  A pg_restore into another cluster
 * (or a pg_upgrade) brings the source's row: the restored events' xids are
 * the source's, meaningless here, so each is converted to row tracking,
 * published (published_at = now) if the source's progress covered it and
 * pending otherwise; then the row is replaced by a fresh one for this
 * cluster.  A pg_restore into the same cluster brings a second local row
 * beside the one CREATE EXTENSION wrote: the events become row-tracked as
 * well, published only where every row covers them.  Both cases are
 * convert_restored_events().  emit() tracks events row by row until this
 * has run (it checks for one local row).
 */
void
outbox_snapshot_adopt(void)
{
	int64		local = (int64) GetSystemIdentifier();
	Oid			types[1] = {INT8OID};
	Datum		args[1] = {Int64GetDatum(local)};
	uint64		nlocal;
	uint64		nrows;
	bool		isnull;

	if (SPI_execute_plan(outbox_prepare_plan(&count_plan,
								   "SELECT pg_catalog.count(*) FILTER (WHERE system_identifier = $1),"
								   "       pg_catalog.count(*) FROM outbox.relay_progress",
								   1, types),
						 args, NULL, false, 1) != SPI_OK_SELECT)
		elog(ERROR, "outbox: could not read outbox.relay_progress");
	nlocal = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	nrows = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	if (nlocal == 1 && nrows == 1)
		return;

	convert_restored_events(nlocal == nrows, nrows);
	reset_progress(args, types);
}

/*
 * Turn every event tracked by snapshot into a row-tracked one after a
 * restore: published (published_at = now) only if every progress row that
 * can speak for it covers it, pending otherwise.  Nothing is lost; an event
 * its source already sent may be sent again.
 *
 * Which rows can speak for an event?  A restored event's xid means
 * something only to the cluster it was written in, and which database's
 * relay saw it is not known either.  A row of another cluster speaks for
 * every event.  A row of this cluster speaks for every event whose xid this
 * cluster could have given out, that is, below the xmax of a snapshot taken
 * now; an event at or above it cannot be this cluster's (a restored event of
 * a busier cluster), and this cluster's rows say nothing about it.
 *
 * So a pg_restore --data-only of another cluster's dump into a database
 * whose own relay already ran keeps that database's own progress row in the
 * judgement of its own pending events (ignoring it, as before, marked them
 * published by the other cluster's snapshot, never sent).  And a restore
 * into a fresh database of another cluster, whose xids are all far below
 * the source's, still keeps what the source published as published.
 */
static void
convert_restored_events(bool same_cluster, uint64 nrows)
{
	Oid			types[1] = {INT8OID};
	Datum		args[1] = {Int64GetDatum((int64) GetSystemIdentifier())};

	if (SPI_execute_plan(outbox_prepare_plan(&convert_plan,
								   "UPDATE outbox.events AS e"
								   "   SET published_at = CASE WHEN (SELECT pg_catalog.bool_and(COALESCE("
								   "         pg_catalog.pg_visible_in_snapshot(e.xid, p.snapshot)"
								   "         OR (e.id <= p.batch_last_id"
								   "             AND pg_catalog.pg_visible_in_snapshot(e.xid, p.batch_snapshot)),"
								   "         false))"
								   "         FROM outbox.relay_progress AS p"
								   "        WHERE p.system_identifier <> $1"
								   "           OR e.xid < pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot()))"
								   "       THEN pg_catalog.now() END,"
								   "       xid = NULL"
								   " WHERE e.xid IS NOT NULL",
								   1, types),
						 args, NULL, false, 0) != SPI_OK_UPDATE)
		elog(ERROR, "outbox: could not convert restored events");
	if (same_cluster)
		ereport(LOG,
				(errmsg("outbox: %llu events are now tracked row by row: a restore brought %llu relay progress rows of this cluster",
						(unsigned long long) SPI_processed, (unsigned long long) nrows),
				 errdetail("Which database's relay saw a transaction is not known after a restore: an event is kept as published only if every progress row covers it, the others will be sent (some perhaps again).")));
	else
		ereport(LOG,
				(errmsg("outbox: %llu events written in another cluster are now tracked row by row",
						(unsigned long long) SPI_processed),
				 errdetail("outbox.relay_progress named another system identifier (a pg_restore or pg_upgrade): its transaction ids mean nothing here. Events its progress covered are kept as published, the others will be sent.")));
}

/* replace outbox.relay_progress by one fresh row of this cluster (args[0]) */
static void
reset_progress(Datum *args, Oid *types)
{
	if (SPI_execute_plan(outbox_prepare_plan(&reset_plan,
								   "WITH d AS (DELETE FROM outbox.relay_progress)"
								   " INSERT INTO outbox.relay_progress (system_identifier) VALUES ($1)",
								   1, types),
						 args, NULL, false, 0) != SPI_OK_INSERT)
		elog(ERROR, "outbox: could not reset outbox.relay_progress");
}

/*
 * outbox_snapshot_held
 *		Hash set of the aggregates (hash of type and id, as message.c computes
 *		it) that have an event tracked row by row still pending: their
 *		events of this batch must wait behind it.  With on_failed_event =
 *		skip, failed events hold nothing.  NULL when there are none.
 */
HTAB *
outbox_snapshot_held(void)
{
	HTAB	   *held = NULL;
	HASHCTL		ctl;
	uint64		i;

	if (SPI_execute_plan(outbox_prepare_plan(outbox_on_failed_event == OUTBOX_ON_FAILED_SKIP ?
								   &held_skip_plan : &held_plan,
								   outbox_on_failed_event == OUTBOX_ON_FAILED_SKIP ?
								   "SELECT DISTINCT aggregate_type, aggregate_id FROM outbox.events"
								   " WHERE published_at IS NULL AND xid IS NULL AND failed_at IS NULL" :
								   "SELECT DISTINCT aggregate_type, aggregate_id FROM outbox.events"
								   " WHERE published_at IS NULL AND xid IS NULL",
								   0, NULL),
						 NULL, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "outbox: could not read held aggregates");
	if (SPI_processed == 0)
		return NULL;
	ctl.keysize = sizeof(uint64);
	ctl.entrysize = sizeof(uint64);
	ctl.hcxt = CurrentMemoryContext;
	held = hash_create("outbox held aggregates", Max(SPI_processed, 16), &ctl,
					   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	for (i = 0; i < SPI_processed; i++)
	{
		char	   *type = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1);
		char	   *id = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 2);
		uint64		h = outbox_aggregate_hash(type, id);

		(void) hash_search(held, &h, HASH_ENTER, NULL);
	}
	return held;
}

/*
 * outbox_snapshot_demote
 *		Track these events (ids, n of them) row by row from now on: they
 *		failed, or wait behind an event of their aggregate that did.  The
 *		relay's 1.3 machinery (attempts, backoff, dead letters, hold/skip)
 *		takes them from there, in id order.
 */
void
outbox_snapshot_demote(Datum *ids, int n)
{
	Oid			types[1] = {INT8ARRAYOID};
	Datum		args[1];

	if (n == 0)
		return;
	args[0] = PointerGetDatum(construct_array(ids, n, INT8OID, sizeof(int64),
											  FLOAT8PASSBYVAL, TYPALIGN_DOUBLE));
	if (SPI_execute_plan(outbox_prepare_plan(&demote_plan,
								   "UPDATE outbox.events SET xid = NULL WHERE id = ANY ($1)",
								   1, types),
						 args, NULL, false, 0) != SPI_OK_UPDATE ||
		SPI_processed != (uint64) n)
		elog(ERROR, "outbox: could not hand %d events over to row tracking", n);
}

/*
 * outbox_aggregate_hash
 *		64-bit hash of an aggregate (type and id), for the relay's in-memory
 *		sets.  A collision only makes an unrelated aggregate wait a little.
 */
uint64
outbox_aggregate_hash(const char *aggregate_type, const char *aggregate_id)
{
	return hash_combine64(hash_bytes_extended((const unsigned char *) aggregate_type,
											  strlen(aggregate_type), 0),
						  hash_bytes_extended((const unsigned char *) aggregate_id,
											  strlen(aggregate_id), 0));
}

/*
 * outbox_snapshot_oldest_created_before
 *		True if the event of the oldest transaction tracked by snapshot was
 *		created before cutoff.  The retention runs its chunks only then:
 *		otherwise each would read CLEANUP_CHUNK young events in vain, every
 *		second.  The probe reads events_xid_idx, one entry: "oldest by id"
 *		would walk the primary key past every row-tracked event kept below
 *		(after a switch from row mode, a minute's worth), every second.  An
 *		old transaction's young event can delay the retention of the others
 *		until it is due itself; retention is a minimum age, never a maximum.
 */
bool
outbox_snapshot_oldest_created_before(TimestampTz cutoff)
{
	Oid			types[1] = {TIMESTAMPTZOID};
	Datum		args[1] = {TimestampTzGetDatum(cutoff)};
	bool		isnull;
	Datum		d;

	if (SPI_execute_plan(outbox_prepare_plan(&oldest_plan,
								   "SELECT created_at < $1 FROM outbox.events"
								   " WHERE xid IS NOT NULL ORDER BY xid, id LIMIT 1",
								   1, types),
						 args, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "outbox: could not read the oldest event");
	if (SPI_processed == 0)
		return false;
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return !isnull && DatumGetBool(d);
}

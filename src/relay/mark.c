/*-------------------------------------------------------------------------
 *
 * mark.c
 *	  Delivery reports go back into the event rows: acknowledged rows are
 *	  marked published (or deleted, with outbox.retention = 0), failed rows
 *	  get attempts + 1, last_error and a backoff, and from schema 1.1 on the
 *	  one that reaches outbox.max_attempts is marked failed (dead letter).
 *
 * A row is marked published only after its delivery report said Kafka
 * acknowledged it (acks=all), in the same transaction that claimed it
 * (batch.c).  Which failures count against an event, and which make it a
 * suspect, is decided here; how that keeps per-aggregate order is told in
 * message.c.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/mark.h"
#include "config/guc.h"
#include "kafka/producer.h"
#include "relay/message.h"
#include "relay/relay_xact.h"
#include "relay/vacuum.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* first retry of a failed event after this long, doubling up to the cap */
#define RETRY_BACKOFF_BASE_MS	1000

/*
 * Acknowledged rows are found again by their ctid: they are locked by this
 * transaction since the claim, so it cannot have changed, and a TID scan
 * saves an index descent per row.
 */
static const char *const mark_published_sql =
"UPDATE outbox.events SET published_at = $2 WHERE ctid = ANY($1)";

static const char *const delete_published_sql =
"DELETE FROM outbox.events WHERE ctid = ANY($1)";

/*
 * Record failed attempts.  From 1.1 on, permanent failures are counted
 * separately and the one that reaches outbox.max_attempts marks the event
 * failed; RETURNING tells which rows that happened to.
 */
static const char *const mark_failed_sql_v10 =
"UPDATE outbox.events AS e"
"   SET attempts = e.attempts + 1, last_error = f.error, next_attempt_at = f.next_attempt_at"
"  FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]),"
"                  pg_catalog.unnest($2::pg_catalog.text[]),"
"                  pg_catalog.unnest($3::pg_catalog.timestamptz[]),"
"                  pg_catalog.unnest($4::pg_catalog.bool[]))"
"       AS f(id, error, next_attempt_at, permanent)"
" WHERE e.id = f.id"
" RETURNING false";

static const char *const mark_failed_sql =
"UPDATE outbox.events AS e"
"   SET attempts = e.attempts + 1, last_error = f.error, next_attempt_at = f.next_attempt_at,"
"       permanent_failures = e.permanent_failures + f.permanent::pg_catalog.int4,"
"       failed_at = CASE WHEN f.permanent AND e.permanent_failures + 1 >= $5 THEN $6 END"
"  FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]),"
"                  pg_catalog.unnest($2::pg_catalog.text[]),"
"                  pg_catalog.unnest($3::pg_catalog.timestamptz[]),"
"                  pg_catalog.unnest($4::pg_catalog.bool[]))"
"       AS f(id, error, next_attempt_at, permanent)"
" WHERE e.id = f.id"
" RETURNING e.failed_at IS NOT NULL";

/* saved plans, prepared on first use in this worker */
static SPIPlanPtr mark_published_plan = NULL;
static SPIPlanPtr delete_published_plan = NULL;
static SPIPlanPtr mark_failed_plan_v10 = NULL;
static SPIPlanPtr mark_failed_plan = NULL;

/* highest id marked published by this process; bounds the retention scan */
static int64 highest_published_id = 0;

/* the rows to write back, collected from a batch's delivery reports */
typedef struct Marks
{
	TimestampTz now;			/* published_at, failed_at, backoff start */
	Datum	   *published_ids;	/* ctids of acknowledged rows */
	int			npublished;
	Datum	   *failed_ids;		/* ids of failed rows ... */
	Datum	   *failed_errors;	/* ... their error text ... */
	Datum	   *failed_next;	/* ... next attempt ... */
	Datum	   *failed_permanent;	/* ... and whether it counts as permanent */
	int			nfailed;
} Marks;

static int	count_refused(OutboxProducer *producer, BatchEntry *entries, int n);
static void classify_deliveries(OutboxProducer *producer, BatchEntry *entries,
								int n, bool by_snapshot, Marks *marks,
								MarkCounts *counts);
static void classify_failure(BatchEntry *e, OutboxDelivery *d, bool shared,
							 Marks *marks, MarkCounts *counts);
static void count_overtaken(OutboxProducer *producer, BatchEntry *entries,
							int n, MarkCounts *counts);
static void write_published(Marks *marks);
static void write_failed(Marks *marks, bool dead_letters, MarkCounts *counts);
static void check_marked(uint64 changed, int expected, const char *command);
static char *delivery_error_text(rd_kafka_resp_err_t err);

/*
 * outbox_mark_results
 *		Apply the delivery reports to the table: acknowledged rows are
 *		marked published (or deleted), failed rows get attempts + 1,
 *		last_error and a backoff.  Rows without a report (aborted batch, held
 *		back, fatal error) are left exactly as they were.
 *
 * entries[0..n-1] are the batch's rows, producer->deliveries their reports.
 * dead_letters: the schema has failed_at (1.1 and later).  by_snapshot: the
 * rows are tracked by snapshot (relay_snapshot_batch), so acknowledged rows
 * are only counted; their progress record says they were published.  Adds
 * what was done to *counts, which the caller zeroed.  Raises ERROR when a
 * statement fails or does not change every row it was given (check_marked).
 */
void
outbox_mark_results(OutboxProducer *producer, BatchEntry *entries, int n,
					bool dead_letters, bool by_snapshot, MarkCounts *counts)
{
	Marks		marks;

	marks.now = GetCurrentTimestamp();
	marks.published_ids = palloc(sizeof(Datum) * n);
	marks.npublished = 0;
	marks.failed_ids = palloc(sizeof(Datum) * n);
	marks.failed_errors = palloc(sizeof(Datum) * n);
	marks.failed_next = palloc(sizeof(Datum) * n);
	marks.failed_permanent = palloc(sizeof(Datum) * n);
	marks.nfailed = 0;

	classify_deliveries(producer, entries, n, by_snapshot, &marks, counts);
	if (marks.nfailed > 0)
		count_overtaken(producer, entries, n, counts);
	if (!by_snapshot)
		counts->published = marks.npublished;

	if (marks.npublished > 0)
		write_published(&marks);
	if (marks.nfailed > 0)
		write_failed(&marks, dead_letters, counts);
}

/*
 * A broker refuses a partition's whole record batch: when a request held
 * several messages, each gets the error, though one of them (too large, too
 * old) may be the cause.  A refusal counts against an event only when it is
 * known to be its own: it was produced alone, or it was the only one refused
 * in this batch.  The others are suspects: their attempt is recorded,
 * without counting it as permanent, and they are sent again at once, each
 * alone (message.c).
 *
 * count_refused returns how many produced rows of the batch were refused
 * permanently.
 */
static int
count_refused(OutboxProducer *producer, BatchEntry *entries, int n)
{
	int			nrefused = 0;
	int			i;

	for (i = 0; i < n; i++)
	{
		if (entries[i].produced && outbox_delivery_failed(&entries[i], &producer->deliveries[i]) &&
			outbox_kafka_error_is_permanent(producer->deliveries[i].err))
			nrefused++;
	}
	return nrefused;
}

/*
 * Sort the rows of the batch by their reports into marks: published, or
 * failed (see classify_failure).  Rows held back or without a verdict are
 * left out.
 */
static void
classify_deliveries(OutboxProducer *producer, BatchEntry *entries, int n,
					bool by_snapshot, Marks *marks, MarkCounts *counts)
{
	int			nrefused = count_refused(producer, entries, n);
	int			i;

	for (i = 0; i < n; i++)
	{
		BatchEntry *e = &entries[i];
		OutboxDelivery *d = &producer->deliveries[i];

		if (e->held_back)
		{
			counts->held_back++;
			continue;
		}
		if (e->produced && d->reported && d->err == RD_KAFKA_RESP_ERR_NO_ERROR)
		{
			if (by_snapshot)
			{
				/* the progress record says it (relay_snapshot_batch) */
				counts->published++;
				continue;
			}
			marks->published_ids[marks->npublished++] = PointerGetDatum(&e->ctid);
			highest_published_id = Max(highest_published_id, e->id);
			if (e->isolated)
				outbox_set_suspect(e->id, false);
			continue;
		}
		if (!outbox_delivery_failed(e, d))
			continue;			/* no verdict (purged, fatal, aborted before
								 * its report): send it again later */
		classify_failure(e, d, nrefused > 1, marks, counts);
	}
}

/*
 * Add a failed row to marks: its error, whether the failure is permanent,
 * and when it is tried again.  A permanent refusal of a row produced with
 * others, when more than one was refused (shared), makes it a suspect: tried
 * again at once, not counted as permanent.
 */
static void
classify_failure(BatchEntry *e, OutboxDelivery *d, bool shared,
				 Marks *marks, MarkCounts *counts)
{
	rd_kafka_resp_err_t err;
	char	   *text;
	bool		permanent;
	bool		suspect = false;
	int			k = marks->nfailed;

	if (e->produced)
	{
		err = d->err;
		text = delivery_error_text(err);
	}
	else
	{
		err = e->error;
		text = e->error_text;
	}

	permanent = outbox_kafka_error_is_permanent(err);
	if (permanent && e->produced && !e->isolated && shared)
	{
		suspect = true;
		permanent = false;
		counts->failed_unattributed++;
	}
	else if (permanent)
		counts->failed_permanent++;
	else
		counts->failed_transient++;
	if (suspect || permanent)
		outbox_set_suspect(e->id, suspect);
	marks->failed_permanent[k] = BoolGetDatum(permanent);
	if (counts->first_error == NULL)
		counts->first_error = MemoryContextStrdup(counts->cxt, text);

	marks->failed_ids[k] = Int64GetDatum(e->id);
	marks->failed_errors[k] = CStringGetTextDatum(text);
	marks->failed_next[k] = suspect ? TimestampTzGetDatum(marks->now) :
		TimestampTzGetDatum(TimestampTzPlusMilliseconds(marks->now,
														Min((int64) outbox_retry_backoff_max,
															(int64) RETRY_BACKOFF_BASE_MS << Min(e->attempts, 20))));
	marks->nfailed++;
}

/*
 * Did a later event of a failed event's aggregate get through anyway?
 * (It should not: see enable.gapless.guarantee in kafka_config.c.)
 * Count each such event once.
 */
static void
count_overtaken(OutboxProducer *producer, BatchEntry *entries, int n,
				MarkCounts *counts)
{
	int			i;

	for (i = 0; i < n; i++)
	{
		if (!outbox_delivery_failed(&entries[i], &producer->deliveries[i]))
			continue;
		for (int j = i + 1; j < n; j++)
		{
			if (entries[j].aggregate_hash == entries[i].aggregate_hash &&
				!entries[j].overtook && entries[j].produced &&
				producer->deliveries[j].reported &&
				producer->deliveries[j].err == RD_KAFKA_RESP_ERR_NO_ERROR)
			{
				entries[j].overtook = true;
				counts->overtaken++;
			}
		}
	}
}

/*
 * Mark the acknowledged rows published, or delete them with
 * outbox.retention = 0.
 */
static void
write_published(Marks *marks)
{
	ArrayType  *ids = construct_array(marks->published_ids, marks->npublished,
									  TIDOID, sizeof(ItemPointerData), false,
									  TYPALIGN_SHORT);
	Datum		args[2] = {PointerGetDatum(ids), TimestampTzGetDatum(marks->now)};
	int			ret;

	if (outbox_retention == 0)
	{
		Oid			types[1] = {TIDARRAYOID};

		ret = SPI_execute_plan(outbox_prepare_plan(&delete_published_plan,
												   delete_published_sql, 1, types),
							   args, NULL, false, 0);
	}
	else
	{
		Oid			types[2] = {TIDARRAYOID, TIMESTAMPTZOID};

		ret = SPI_execute_plan(outbox_prepare_plan(&mark_published_plan,
												   mark_published_sql, 2, types),
							   args, NULL, false, 0);
	}
	if (ret < 0)
		elog(ERROR, "could not mark events published: %s",
			 SPI_result_code_string(ret));
	check_marked(SPI_processed, marks->npublished,
				 outbox_retention == 0 ? "DELETE" : "UPDATE");
	if (outbox_retention == 0)
		outbox_vacuum_count_deleted(SPI_processed);
}

/*
 * Record the failed attempts: attempts + 1, last_error, the backoff; and
 * count the rows this made dead letters (failed_at set).
 */
static void
write_failed(Marks *marks, bool dead_letters, MarkCounts *counts)
{
	Oid			types[6] = {INT8ARRAYOID, TEXTARRAYOID, TIMESTAMPTZARRAYOID,
	BOOLARRAYOID, INT4OID, TIMESTAMPTZOID};
	Datum		args[6];
	SPIPlanPtr	plan;
	int			nfailed = marks->nfailed;
	int			ret;

	args[0] = PointerGetDatum(construct_array(marks->failed_ids, nfailed, INT8OID,
											  sizeof(int64), FLOAT8PASSBYVAL,
											  TYPALIGN_DOUBLE));
	args[1] = PointerGetDatum(construct_array(marks->failed_errors, nfailed, TEXTOID,
											  -1, false, TYPALIGN_INT));
	args[2] = PointerGetDatum(construct_array(marks->failed_next, nfailed, TIMESTAMPTZOID,
											  sizeof(TimestampTz), FLOAT8PASSBYVAL,
											  TYPALIGN_DOUBLE));
	args[3] = PointerGetDatum(construct_array(marks->failed_permanent, nfailed, BOOLOID,
											  sizeof(bool), true, TYPALIGN_CHAR));
	args[4] = Int32GetDatum(outbox_max_attempts);
	args[5] = TimestampTzGetDatum(marks->now);
	if (dead_letters)
		plan = outbox_prepare_plan(&mark_failed_plan, mark_failed_sql, 6, types);
	else
		plan = outbox_prepare_plan(&mark_failed_plan_v10, mark_failed_sql_v10, 4, types);
	ret = SPI_execute_plan(plan, args, NULL, false, 0);
	if (ret != SPI_OK_UPDATE_RETURNING)
		elog(ERROR, "could not record failed deliveries: %s",
			 SPI_result_code_string(ret));
	check_marked(SPI_processed, nfailed, "UPDATE");
	for (uint64 k = 0; k < SPI_processed; k++)
	{
		bool		isnull;

		if (DatumGetBool(SPI_getbinval(SPI_tuptable->vals[k],
									   SPI_tuptable->tupdesc, 1, &isnull)))
			counts->dead_lettered++;
	}
}

/*
 * check_marked
 *		ERROR unless the statement that recorded a batch's outcome changed
 *		every row it was given.
 *
 * The rows are locked by this transaction since the claim, so only a
 * trigger or rule on outbox.events can make the statement skip one.  Going
 * on would leave the row pending and send it again at once, for ever and
 * without a word in the log; the ERROR is logged and retried with backoff,
 * and outbox.status shows it (state error, last_error).
 */
static void
check_marked(uint64 changed, int expected, const char *command)
{
	if (changed != (uint64) expected)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("outbox relay could not record the outcome of %d event(s): its %s changed %llu row(s)",
						expected, command, (unsigned long long) changed),
				 errdetail("Kafka has the events; they stay pending and are sent again when the relay retries."),
				 errhint("Remove triggers and rules on outbox.events that skip or redirect the relay's UPDATE or DELETE.")));
}

/*
 * outbox_delivery_failed
 *		Did this row's delivery fail, in a way that counts as an attempt?
 *
 * A row dropped by us or by a stopped producer (purged, fatal) has no
 * verdict and is simply sent again.  e is the row's entry, d its delivery
 * report (read only when it was produced).  Raises no error.
 */
bool
outbox_delivery_failed(const BatchEntry *e, const OutboxDelivery *d)
{
	if (!e->produced)
		return e->error != RD_KAFKA_RESP_ERR_NO_ERROR;
	return d->reported && d->err != RD_KAFKA_RESP_ERR_NO_ERROR &&
		d->err != RD_KAFKA_RESP_ERR__PURGE_QUEUE &&
		d->err != RD_KAFKA_RESP_ERR__PURGE_INFLIGHT &&
		d->err != RD_KAFKA_RESP_ERR__FATAL;
}

/* the text recorded in last_error for a delivery report's error */
static char *
delivery_error_text(rd_kafka_resp_err_t err)
{
	return psprintf("%s (%s)", rd_kafka_err2str(err), rd_kafka_err2name(err));
}

/*
 * outbox_highest_published_id
 *		Highest id this process marked published since it started, 0 if none;
 *		retention (retention.c) scans no further.  Raises no error.
 */
int64
outbox_highest_published_id(void)
{
	return highest_published_id;
}

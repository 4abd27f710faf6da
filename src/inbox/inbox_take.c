/*-------------------------------------------------------------------------
 *
 * inbox_take.c
 *	  outbox.inbox_take(): queue mode, events handed to application code
 *	  inside the application's own transaction.
 *
 * A subscription without a handler has the inbox worker insert each event
 * into outbox.inbox, in the transaction that advances its Kafka offsets.
 * inbox_take() deletes and returns a few of them in the caller's
 * transaction, so an application (Java, Go, Node, ...) that takes events
 * and writes their effects in one transaction applies each event exactly
 * once: a rollback gives them back, a commit removes them with the effects.
 *
 * Order: a key's events are handed out in id order, and a key is taken by
 * one transaction at a time.  Each key with pending events has a row in
 * outbox.inbox_keys (the worker writes it with the events, see
 * inbox_handler.c); a take locks key rows, oldest first, FOR UPDATE SKIP
 * LOCKED, until they hold as many events as it may return (1 key, then 2,
 * 4, ... per round, so that a few hot keys spread over several takers and
 * many cold ones cost few rounds), then deletes up to max of their events
 * and moves each key's first_id on, or drops the row of a key it drained.
 * Events without a key have no order to keep: they fill the rest, skipping
 * rows other takers hold.  Each call costs what it returns, not the
 * backlog.  Several takers never wait on each other nor reorder a key.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "access/htup_details.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/tuplestore.h"

PG_FUNCTION_INFO_V1(outbox_inbox_take);

/* one round of key rows, locked: the next chunk after first_id $2 */
#define LOCK_KEYS_SQL \
	"SELECT topic, key, pending, first_id FROM outbox.inbox_keys" \
	" WHERE subscription = $1 AND first_id > $2" \
	" ORDER BY first_id LIMIT $3 FOR UPDATE SKIP LOCKED"

/*
 * the locked keys' events: up to $4, deleted, and the keys' rows moved on
 * (dropped when drained, or when no event is left for them at all)
 */
#define TAKE_KEYS_SQL \
	"WITH k AS (SELECT * FROM ROWS FROM (pg_catalog.unnest($2::text[]), pg_catalog.unnest($3::text[])) AS k(topic, key))," \
	" pick AS (SELECT e.id, e.topic, e.key FROM k CROSS JOIN LATERAL" \
	"            (SELECT i.id, i.topic, i.key FROM outbox.inbox AS i" \
	"              WHERE i.subscription = $1 AND i.topic = k.topic AND i.key = k.key" \
	"              ORDER BY i.id LIMIT $4) AS e" \
	"          ORDER BY e.id LIMIT $4)," \
	" taken AS (DELETE FROM outbox.inbox AS i USING pick WHERE i.id = pick.id RETURNING i.*)," \
	" cnt AS (SELECT k.topic, k.key, pg_catalog.count(p.id) AS n," \
	"                COALESCE(pg_catalog.max(p.id), 0) AS last" \
	"           FROM k LEFT JOIN pick AS p ON p.topic = k.topic AND p.key = k.key" \
	"          GROUP BY k.topic, k.key)," \
	" rest AS (SELECT c.topic, c.key, c.n," \
	"                 (SELECT pg_catalog.min(i.id) FROM outbox.inbox AS i" \
	"                   WHERE i.subscription = $1 AND i.topic = c.topic AND i.key = c.key" \
	"                     AND i.id > c.last) AS next FROM cnt AS c)," \
	" moved AS (UPDATE outbox.inbox_keys AS x" \
	"              SET first_id = r.next, pending = GREATEST(x.pending - r.n, 1)" \
	"             FROM rest AS r WHERE x.subscription = $1 AND x.topic = r.topic" \
	"              AND x.key = r.key AND r.next IS NOT NULL RETURNING 1)," \
	" gone AS (DELETE FROM outbox.inbox_keys AS x USING rest AS r" \
	"           WHERE x.subscription = $1 AND x.topic = r.topic AND x.key = r.key" \
	"             AND r.next IS NULL RETURNING 1)" \
	" SELECT * FROM taken"

/* events without a key: up to $2, skipping those other takers hold */
#define TAKE_KEYLESS_SQL \
	"DELETE FROM outbox.inbox AS i" \
	" WHERE i.id IN (SELECT c.id FROM outbox.inbox AS c" \
	"                 WHERE c.subscription = $1 AND c.key IS NULL" \
	"                 ORDER BY c.id LIMIT $2 FOR UPDATE SKIP LOCKED)" \
	" RETURNING i.*"

/* the most key rows one round locks */
#define MAX_ROUND_KEYS	1024

/* a taken row, to sort by id */
typedef struct TakenRow
{
	int64		id;
	HeapTuple	tuple;
} TakenRow;

static int
taken_cmp(const void *a, const void *b)
{
	int64		x = ((const TakenRow *) a)->id;
	int64		y = ((const TakenRow *) b)->id;

	return x < y ? -1 : x > y;
}

/*
 * Lock key rows of subscription name until they hold max events or none is
 * left; their topics and keys into *topics and *keys.  Returns how many.
 */
static int
lock_keys(Datum name, int max, Datum **topics, Datum **keys)
{
	int			nkeys = 0;
	int			room = 16;
	int64		pending = 0;
	int64		after = 0;
	int			chunk = 1;

	*topics = palloc(sizeof(Datum) * room);
	*keys = palloc(sizeof(Datum) * room);
	while (pending < max)
	{
		Datum		values[3] = {name, Int64GetDatum(after), Int64GetDatum(chunk)};
		uint64		r;

		if (SPI_execute_with_args(LOCK_KEYS_SQL, 3, (Oid[]) {TEXTOID, INT8OID, INT8OID},
								  values, NULL, false, 0) != SPI_OK_SELECT)
			elog(ERROR, "outbox: locking the keys of a take failed");
		for (r = 0; r < SPI_processed; r++)
		{
			HeapTuple	t = SPI_tuptable->vals[r];
			TupleDesc	d = SPI_tuptable->tupdesc;
			bool		isnull;

			if (nkeys == room)
			{
				room *= 2;
				*topics = repalloc(*topics, sizeof(Datum) * room);
				*keys = repalloc(*keys, sizeof(Datum) * room);
			}
			(*topics)[nkeys] = SPI_getbinval(t, d, 1, &isnull);
			(*keys)[nkeys] = SPI_getbinval(t, d, 2, &isnull);
			(*topics)[nkeys] = SPI_datumTransfer((*topics)[nkeys], false, -1);
			(*keys)[nkeys] = SPI_datumTransfer((*keys)[nkeys], false, -1);
			nkeys++;
			pending += DatumGetInt64(SPI_getbinval(t, d, 3, &isnull));
			after = DatumGetInt64(SPI_getbinval(t, d, 4, &isnull));
		}
		if (SPI_processed < (uint64) chunk)
			break;				/* no more keys, or the others are taken */
		chunk = Min(chunk * 2, MAX_ROUND_KEYS);
	}
	return nkeys;
}

/* run sql (taken rows) and append its rows to *rows */
static void
collect(const char *sql, int nargs, Oid *types, Datum *values, TakenRow **rows,
		int *n, int *room, TupleDesc *desc)
{
	uint64		r;
	int			ret = SPI_execute_with_args(sql, nargs, types, values, NULL, false, 0);

	if (ret != SPI_OK_SELECT && ret != SPI_OK_DELETE_RETURNING)
		elog(ERROR, "outbox: taking events failed: %s", SPI_result_code_string(ret));
	*desc = SPI_tuptable->tupdesc;
	for (r = 0; r < SPI_processed; r++)
	{
		bool		isnull;

		if (*n == *room)
		{
			*room *= 2;
			*rows = repalloc(*rows, sizeof(TakenRow) * *room);
		}
		(*rows)[*n].tuple = SPI_copytuple(SPI_tuptable->vals[r]);
		(*rows)[*n].id = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[r], *desc, 1, &isnull));
		(*n)++;
	}
}

/*
 * outbox_inbox_take
 *		SQL: outbox.inbox_take(subscription text, max integer DEFAULT 100)
 *		RETURNS SETOF outbox.inbox (see the file header).  The caller needs
 *		the privileges of the subscription's owner (42501); 42704 if there
 *		is no such subscription, 22023 if max is below 1.
 */
Datum
outbox_inbox_take(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Oid			caller = GetUserId();
	char	   *name;
	Oid			save_userid;
	int			save_sec;
	int			max;
	int			nkeys;
	Datum	   *topics;
	Datum	   *keys;
	TakenRow   *rows;
	int			n = 0;
	int			room = 64;
	TupleDesc	desc = NULL;
	int			i;
	bool		has_handler;

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("the arguments of outbox.inbox_take() must not be NULL")));
	if (PG_GETARG_INT32(1) < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max must be 1 or more, not %d", PG_GETARG_INT32(1))));
	name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	InitMaterializedSRF(fcinfo, 0);

	inbox_switch_to_owner(&save_userid, &save_sec);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	(void) inbox_check_manage(name, caller, false, &has_handler);
	/* a handler's subscription queues nothing: 0 rows forever would look like an empty queue */
	if (has_handler)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("subscription \"%s\" has a handler: its events are applied, not queued", name),
				 errhint("outbox.inbox_take() is for subscriptions made without a handler (queue mode).")));
	max = PG_GETARG_INT32(1);
	nkeys = lock_keys(CStringGetTextDatum(name), max, &topics, &keys);
	rows = palloc(sizeof(TakenRow) * room);
	if (nkeys > 0)
	{
		Datum		args[4];

		args[0] = CStringGetTextDatum(name);
		args[1] = PointerGetDatum(construct_array(topics, nkeys, TEXTOID, -1, false, TYPALIGN_INT));
		args[2] = PointerGetDatum(construct_array(keys, nkeys, TEXTOID, -1, false, TYPALIGN_INT));
		args[3] = Int64GetDatum(max);
		collect(TAKE_KEYS_SQL, 4, (Oid[]) {TEXTOID, TEXTARRAYOID, TEXTARRAYOID, INT8OID},
				args, &rows, &n, &room, &desc);
	}
	if (n < max)
	{
		Datum		args[2];

		args[0] = CStringGetTextDatum(name);
		args[1] = Int64GetDatum(max - n);
		collect(TAKE_KEYLESS_SQL, 2, (Oid[]) {TEXTOID, INT8OID}, args, &rows, &n, &room, &desc);
	}
	if (n > 0 && desc->natts != rsinfo->setDesc->natts)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("outbox.inbox has %d columns, the result of outbox.inbox_take() %d",
						desc->natts, rsinfo->setDesc->natts)));
	qsort(rows, n, sizeof(TakenRow), taken_cmp);
	for (i = 0; i < n; i++)
	{
		Datum	   *row = palloc(sizeof(Datum) * rsinfo->setDesc->natts);
		bool	   *nulls = palloc(sizeof(bool) * rsinfo->setDesc->natts);

		heap_deform_tuple(rows[i].tuple, desc, row, nulls);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, row, nulls);
	}
	SPI_finish();
	inbox_switch_back(save_userid, save_sec);
	return (Datum) 0;
}

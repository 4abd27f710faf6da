/*-------------------------------------------------------------------------
 *
 * inbox_status.c
 *	  The inbox as seen from outside: outbox.inbox_worker_partitions() (the
 *	  live half of outbox.inbox_status) and the inbox rows of
 *	  outbox.cluster_status().
 *
 * Both read shared memory only (inbox_shmem.c), entry by entry under its
 * spinlock, and build the rows afterwards: a status query never keeps a
 * worker waiting.  The persistent half of outbox.inbox_status (offsets,
 * counts, dead letters) comes from the tables, in the view.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/inbox_shmem.h"
#include "shared/shmem.h"

#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

PG_FUNCTION_INFO_V1(outbox_inbox_worker_partitions);

/*
 * inbox_state_name
 *		The name outbox.inbox_status and outbox.cluster_status() show.
 */
const char *
inbox_state_name(InboxState state)
{
	switch (state)
	{
		case INBOX_STATE_STARTING:
			return "starting";
		case INBOX_STATE_RUNNING:
			return "running";
		case INBOX_STATE_NOT_CONFIGURED:
			return "not_configured";
		case INBOX_STATE_CONFIG_ERROR:
			return "config_error";
		case INBOX_STATE_BROKER_DOWN:
			return "broker_down";
		case INBOX_STATE_ERROR:
			return "error";
		case INBOX_STATE_STALLED:
			return "stalled";
		case INBOX_STATE_WAITING_FOR_TOPIC:
			return "waiting_for_topic";
	}
	return "unknown";
}

/* a timestamp column: NULL when zero */
static void
put_time(Datum *value, bool *isnull, TimestampTz t)
{
	*value = TimestampTzGetDatum(t);
	*isnull = t == 0;
}

/* a text column: NULL when empty */
static void
put_text(Datum *value, bool *isnull, const char *s)
{
	*isnull = s == NULL || s[0] == '\0';
	if (!*isnull)
		*value = CStringGetTextDatum(s);
}

/*
 * The worker row of database dboid's inbox worker, if one runs: *slot and
 * *pid set, false if none.
 */
static bool
find_worker(Oid dboid, int *slot, pid_t *pid, TimestampTz *started_at,
			char *dbname)
{
	int			i;

	for (i = 0; i < outbox_shared->nslots; i++)
	{
		OutboxRelaySlot *s = &outbox_shared->slots[i];
		bool		match;

		SpinLockAcquire(&s->mutex);
		match = s->inbox && s->worker_latch != NULL &&
			(dboid == InvalidOid || s->database_oid == dboid);
		*pid = s->worker_pid;
		*started_at = s->started_at;
		if (dbname != NULL)
			strlcpy(dbname, s->database_name, NAMEDATALEN);
		SpinLockRelease(&s->mutex);
		if (match)
		{
			*slot = i;
			return true;
		}
	}
	return false;
}

/*
 * outbox_inbox_worker_partitions
 *		SQL: outbox.inbox_worker_partitions() RETURNS SETOF record (pid,
 *		subscription, topic, kafka_partition, high_watermark, state,
 *		last_error, last_error_at, last_applied_at).
 *
 * The current database's inbox worker: first its own row (subscription,
 * topic and kafka_partition NULL), then one row per partition entry it
 * publishes.  No rows when no inbox worker runs here or the library is not
 * preloaded.  Executable by pg_monitor (the SQL grants say so).
 */
Datum
outbox_inbox_worker_partitions(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	TupleDesc	tupdesc;
	Datum		values[9];
	bool		nulls[9];
	InboxWorkerCopy w;
	int			slot;
	pid_t		pid;
	TimestampTz started_at;
	int			i;

	InitMaterializedSRF(fcinfo, 0);
	tupdesc = rsinfo->setDesc;
	if (outbox_shared == NULL || tupdesc->natts != 9 ||
		!find_worker(MyDatabaseId, &slot, &pid, &started_at, NULL) ||
		!inbox_shmem_copy_worker(slot, &w) || !w.serving)
		return (Datum) 0;

	memset(nulls, true, sizeof(nulls));
	values[0] = Int32GetDatum(pid);
	nulls[0] = false;
	values[5] = CStringGetTextDatum(inbox_state_name(w.state));
	nulls[5] = false;
	put_text(&values[6], &nulls[6], w.last_error);
	put_time(&values[7], &nulls[7], w.last_error_at);
	put_time(&values[8], &nulls[8], w.last_applied_at);
	tuplestore_putvalues(rsinfo->setResult, tupdesc, values, nulls);

	for (i = 0; i < inbox_shmem_npartitions(); i++)
	{
		InboxPartitionCopy p;

		if (!inbox_shmem_copy_partition(i, &p) || p.dboid != MyDatabaseId || p.pid != pid)
			continue;
		memset(nulls, false, sizeof(nulls));
		values[0] = Int32GetDatum(p.pid);
		values[1] = CStringGetTextDatum(p.subscription);
		values[2] = CStringGetTextDatum(p.topic);
		values[3] = Int32GetDatum(p.partition);
		values[4] = Int64GetDatum(p.high_watermark);
		nulls[4] = p.high_watermark < 0;
		values[5] = CStringGetTextDatum(inbox_state_name(p.state));
		put_text(&values[6], &nulls[6], p.last_error);
		put_time(&values[7], &nulls[7], p.last_error_at);
		put_time(&values[8], &nulls[8], p.last_applied_at);
		tuplestore_putvalues(rsinfo->setResult, tupdesc, values, nulls);
	}
	return (Datum) 0;
}

/*
 * outbox_inbox_cluster_rows
 *		Add a row of kind inbox for every running inbox worker of the server
 *		to outbox.cluster_status()'s result: published is the records it
 *		applied, failed its dead letters and delivery_errors its failed
 *		handler calls, since it started; last_publish_at its last apply.
 *		Columns are filled by name, like status.c's rows.
 */
void
outbox_inbox_cluster_rows(ReturnSetInfo *rsinfo)
{
	TupleDesc	tupdesc = rsinfo->setDesc;
	int			i;

	for (i = 0; i < outbox_shared->nslots; i++)
	{
		OutboxRelaySlot *s = &outbox_shared->slots[i];
		InboxWorkerCopy w;
		char		dbname[NAMEDATALEN];
		pid_t		pid;
		TimestampTz started_at;
		bool		runs;
		Datum	   *values;
		bool	   *nulls;
		int			c;

		SpinLockAcquire(&s->mutex);
		runs = s->inbox && s->worker_latch != NULL;
		pid = s->worker_pid;
		started_at = s->started_at;
		strlcpy(dbname, s->database_name, NAMEDATALEN);
		SpinLockRelease(&s->mutex);
		if (!runs || !inbox_shmem_copy_worker(i, &w) || !w.serving)
			continue;

		values = palloc0(sizeof(Datum) * tupdesc->natts);
		nulls = palloc0(sizeof(bool) * tupdesc->natts);
		for (c = 0; c < tupdesc->natts; c++)
		{
			const char *name = NameStr(TupleDescAttr(tupdesc, c)->attname);

			if (strcmp(name, "kind") == 0)
				values[c] = CStringGetTextDatum("inbox");
			else if (strcmp(name, "database") == 0)
			{
				values[c] = DirectFunctionCall1(namein, CStringGetDatum(dbname));
				nulls[c] = dbname[0] == '\0';
			}
			else if (strcmp(name, "pid") == 0)
				values[c] = Int32GetDatum(pid);
			else if (strcmp(name, "state") == 0)
				values[c] = CStringGetTextDatum(inbox_state_name(w.state));
			else if (strcmp(name, "published") == 0)
				values[c] = Int64GetDatum(w.applied);
			else if (strcmp(name, "failed") == 0)
				values[c] = Int64GetDatum(w.dead);
			else if (strcmp(name, "delivery_errors") == 0)
				values[c] = Int64GetDatum(w.errors);
			else if (strcmp(name, "last_publish_at") == 0)
				put_time(&values[c], &nulls[c], w.last_applied_at);
			else if (strcmp(name, "last_error") == 0)
				put_text(&values[c], &nulls[c], w.last_error);
			else if (strcmp(name, "last_error_at") == 0)
				put_time(&values[c], &nulls[c], w.last_error_at);
			else if (strcmp(name, "started_at") == 0)
				put_time(&values[c], &nulls[c], started_at);
			else
				nulls[c] = true;
		}
		tuplestore_putvalues(rsinfo->setResult, tupdesc, values, nulls);
		pfree(values);
		pfree(nulls);
	}
}

/*-------------------------------------------------------------------------
 *
 * inbox_status.c
 *	  The inbox as seen from outside: outbox.inbox_worker_partitions() (the
 *	  live half of outbox.inbox_status) and the inbox rows of
 *	  outbox.cluster_status().
 *
 * Both read shared memory only (inbox_shmem.c, inbox_workers.c,
 * inbox_partitions.c), entry by entry under its spinlock, and build the
 * rows afterwards: a status query never keeps a worker waiting.  The persistent half of outbox.inbox_status (offsets,
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
		case INBOX_STATE_WAITING_FOR_WORKER:
			return "waiting_for_worker";
		case INBOX_STATE_FAILING:
			return "failing";
		case INBOX_STATE_PAUSED:
			return "paused";
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
 * The slot of database dboid's inbox launcher (any database's if dboid is
 * InvalidOid, from slot *slot on), with its pid, start and database name;
 * false if none runs.
 */
static bool
find_launcher(Oid dboid, int *slot, pid_t *pid, TimestampTz *started_at,
			  char *dbname)
{
	int			i;

	for (i = *slot; i < outbox_shared->nslots; i++)
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

/* one row of outbox.inbox_worker_partitions() (9 columns) */
static void
put_row(ReturnSetInfo *rsinfo, pid_t pid, const char *subscription,
		const char *topic, int32 partition, int64 high, InboxState state,
		const char *error, TimestampTz error_at, TimestampTz applied_at)
{
	Datum		values[9];
	bool		nulls[9];

	memset(nulls, true, sizeof(nulls));
	values[0] = Int32GetDatum(pid);
	nulls[0] = pid == 0;
	put_text(&values[1], &nulls[1], subscription);
	put_text(&values[2], &nulls[2], topic);
	values[3] = Int32GetDatum(partition);
	nulls[3] = topic == NULL;
	values[4] = Int64GetDatum(high);
	nulls[4] = topic == NULL || high < 0;
	values[5] = CStringGetTextDatum(inbox_state_name(state));
	nulls[5] = false;
	put_text(&values[6], &nulls[6], error);
	put_time(&values[7], &nulls[7], error_at);
	put_time(&values[8], &nulls[8], applied_at);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
}

/*
 * outbox_inbox_worker_partitions
 *		SQL: outbox.inbox_worker_partitions() RETURNS SETOF record (pid,
 *		subscription, topic, kafka_partition, high_watermark, state,
 *		last_error, last_error_at, last_applied_at).
 *
 * The current database's inbox, from shared memory: first its inbox
 * launcher's row (subscription and topic NULL), then one row per inbox
 * worker (subscription set, topic NULL; pid NULL while it waits for a
 * background worker), then one row per partition entry a worker publishes.
 * No rows when no inbox launcher runs here or the library is not preloaded.
 * Executable by pg_monitor (the SQL grants say so).
 */
Datum
outbox_inbox_worker_partitions(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	InboxLauncherCopy l;
	int			slot = 0;
	pid_t		pid;
	TimestampTz started_at;
	int			i;

	InitMaterializedSRF(fcinfo, 0);
	if (outbox_shared == NULL || rsinfo->setDesc->natts != 9 ||
		!find_launcher(MyDatabaseId, &slot, &pid, &started_at, NULL) ||
		!inbox_shmem_copy_launcher(slot, &l) || !l.serving)
		return (Datum) 0;
	put_row(rsinfo, pid, NULL, NULL, 0, -1, l.state, l.last_error,
			l.last_error_at, 0);

	for (i = 0; i < inbox_shmem_nworkers(); i++)
	{
		InboxWorkerCopy w;

		if (!inbox_shmem_copy_worker(i, &w) || w.dboid != MyDatabaseId)
			continue;
		put_row(rsinfo, w.pid, w.subscription, NULL, 0, -1, w.state,
				w.last_error, w.last_error_at, w.last_applied_at);
	}
	for (i = 0; i < inbox_shmem_npartitions(); i++)
	{
		InboxPartitionCopy p;

		if (!inbox_shmem_copy_partition(i, &p) || p.dboid != MyDatabaseId)
			continue;
		put_row(rsinfo, p.pid, p.subscription, p.topic, p.partition,
				p.high_watermark, p.state, p.last_error, p.last_error_at,
				p.last_applied_at);
	}
	return (Datum) 0;
}

/* the database name of the inbox launcher in slot, if it serves dboid */
static void
launcher_database(int slot, Oid dboid, char *dbname)
{
	OutboxRelaySlot *s;

	dbname[0] = '\0';
	if (slot < 0 || slot >= outbox_shared->nslots)
		return;
	s = &outbox_shared->slots[slot];
	SpinLockAcquire(&s->mutex);
	if (s->inbox && s->database_oid == dboid)
		strlcpy(dbname, s->database_name, NAMEDATALEN);
	SpinLockRelease(&s->mutex);
}

/* a row of outbox.cluster_status(), its columns filled by name */
static void
put_cluster_row(ReturnSetInfo *rsinfo, const char *kind, const char *dbname,
				pid_t pid, InboxState state, const InboxWorkerCopy *w,
				const char *error, TimestampTz error_at,
				TimestampTz started_at)
{
	TupleDesc	tupdesc = rsinfo->setDesc;
	Datum	   *values = palloc0(sizeof(Datum) * tupdesc->natts);
	bool	   *nulls = palloc0(sizeof(bool) * tupdesc->natts);
	int			c;

	for (c = 0; c < tupdesc->natts; c++)
	{
		const char *name = NameStr(TupleDescAttr(tupdesc, c)->attname);

		nulls[c] = false;
		if (strcmp(name, "kind") == 0)
			values[c] = CStringGetTextDatum(kind);
		else if (strcmp(name, "database") == 0)
		{
			values[c] = DirectFunctionCall1(namein, CStringGetDatum(dbname));
			nulls[c] = dbname[0] == '\0';
		}
		else if (strcmp(name, "pid") == 0)
		{
			values[c] = Int32GetDatum(pid);
			nulls[c] = pid == 0;
		}
		else if (strcmp(name, "state") == 0)
			values[c] = CStringGetTextDatum(inbox_state_name(state));
		else if (strcmp(name, "published") == 0 && w != NULL)
			values[c] = Int64GetDatum(w->applied);
		else if (strcmp(name, "failed") == 0 && w != NULL)
			values[c] = Int64GetDatum(w->dead);
		else if (strcmp(name, "delivery_errors") == 0 && w != NULL)
			values[c] = Int64GetDatum(w->errors);
		else if (strcmp(name, "last_publish_at") == 0 && w != NULL)
			put_time(&values[c], &nulls[c], w->last_applied_at);
		else if (strcmp(name, "last_error") == 0)
			put_text(&values[c], &nulls[c], error);
		else if (strcmp(name, "last_error_at") == 0)
			put_time(&values[c], &nulls[c], error_at);
		else if (strcmp(name, "started_at") == 0)
			put_time(&values[c], &nulls[c], started_at);
		else
			nulls[c] = true;
	}
	tuplestore_putvalues(rsinfo->setResult, tupdesc, values, nulls);
	pfree(values);
	pfree(nulls);
}

/*
 * outbox_inbox_cluster_rows
 *		Add the inbox's rows of the whole server to outbox.cluster_status()'s
 *		result: kind inbox_launcher per running inbox launcher (state running
 *		or waiting_for_worker), then kind inbox per inbox worker, published
 *		being the records it applied, failed its dead letters and
 *		delivery_errors its failed handler calls since it started,
 *		last_publish_at its last apply (pid NULL, state waiting_for_worker,
 *		for one that could not start).
 */
void
outbox_inbox_cluster_rows(ReturnSetInfo *rsinfo)
{
	int			slot = 0;
	pid_t		pid;
	TimestampTz started_at;
	char		dbname[NAMEDATALEN];
	int			i;

	while (find_launcher(InvalidOid, &slot, &pid, &started_at, dbname))
	{
		InboxLauncherCopy l;

		if (inbox_shmem_copy_launcher(slot, &l) && l.serving)
			put_cluster_row(rsinfo, "inbox_launcher", dbname, pid, l.state, NULL,
							l.last_error, l.last_error_at, started_at);
		slot++;
	}
	for (i = 0; i < inbox_shmem_nworkers(); i++)
	{
		InboxWorkerCopy w;

		if (!inbox_shmem_copy_worker(i, &w))
			continue;
		launcher_database(w.launcher_slot, w.dboid, dbname);
		put_cluster_row(rsinfo, "inbox", dbname, w.pid, w.state, &w,
						w.last_error, w.last_error_at, w.started_at);
	}
}

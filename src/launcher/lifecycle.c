/*-------------------------------------------------------------------------
 *
 * lifecycle.c
 *	  What the launcher must hear about at once: CREATE EXTENSION outbox,
 *	  and DDL on databases.
 *
 * A ProcessUtility hook, installed in every backend of a server that
 * preloads the library, watches for
 *	- CREATE EXTENSION outbox: at commit, the database's OID goes into a
 *	  small list in shared memory and the launcher's latch is set, so that
 *	  it starts (outbox.databases = '*') the database's relay within a
 *	  second.  The callback runs after the commit is visible to new
 *	  snapshots, so the relay finds the extension.
 *	- CREATE DATABASE, ALTER DATABASE: the launcher is woken at commit to
 *	  read pg_database again.
 *	- DROP DATABASE (also WITH (FORCE)), ALTER DATABASE ... RENAME and
 *	  CREATE DATABASE ... TEMPLATE, which PostgreSQL refuses while another
 *	  session is connected to the database (it waits 5 s for them to
 *	  leave): before core runs it, the
 *	  database is marked blocked, its relays get SIGTERM and the hook waits
 *	  up to RELEASE_WAIT_MS for them to exit.  The launcher starts no relay
 *	  in a blocked database; the block ends with the transaction (commit or
 *	  abort), or after BLOCK_MAX_MS should the backend never get there.
 *	  Only a caller allowed to run the statement (superuser or the
 *	  database's owner) releases the relays: anyone else's attempt leaves
 *	  them alone.
 *	- DROP EXTENSION outbox: the events not yet published go with the
 *	  table, which a DBA may not know; they are counted before the drop
 *	  and, if there were any, a WARNING says how many after it.
 *
 * The hook only speeds things up: relays find a dropped extension by
 * themselves, and the launcher reads pg_database every few seconds.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "launcher/lifecycle.h"
#include "shared/shmem.h"

#include <signal.h>

#include "access/xact.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "catalog/namespace.h"
#include "catalog/pg_database.h"
#include "catalog/pg_extension.h"
#include "commands/dbcommands.h"
#include "commands/defrem.h"
#include "miscadmin.h"
#include "nodes/parsenodes.h"
#include "storage/lmgr.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

/* how long DROP/RENAME DATABASE waits for the database's relays to exit */
#define RELEASE_WAIT_MS		5000
/* a block that outlives this was left by a backend that never ended it */
#define BLOCK_MAX_MS		60000

static ProcessUtility_hook_type prev_process_utility_hook = NULL;

/* what the current transaction has to tell the launcher when it ends */
static Oid	created_in = InvalidOid;	/* CREATE EXTENSION outbox here */
static bool wake_at_commit = false;
static int	held_block = -1;	/* index in blocked_db[], or -1 */
static bool callback_registered = false;

static void lifecycle_utility(PlannedStmt *pstmt, const char *queryString,
							  bool readOnlyTree, ProcessUtilityContext context,
							  ParamListInfo params, QueryEnvironment *queryEnv,
							  DestReceiver *dest, QueryCompletion *qc);
static const char *option_value(List *options, const char *name);
static Oid	releasable_database(const char *name);
static void release_database(Oid dboid);
static void lifecycle_xact_callback(XactEvent event, void *arg);
static bool drops_outbox(DropStmt *stmt);
static void lock_events_for_drop(void);
static bool count_unpublished(int64 *pending, int64 *failed);
static void warn_discarded(int64 pending, int64 failed);

/*
 * outbox_install_lifecycle_hook
 *		Install the ProcessUtility hook.  Called from _PG_init in the
 *		postmaster (shared_preload_libraries) only: the hook talks to the
 *		launcher through shared memory.
 */
void
outbox_install_lifecycle_hook(void)
{
	prev_process_utility_hook = ProcessUtility_hook;
	ProcessUtility_hook = lifecycle_utility;
}

/*
 * outbox_database_blocked
 *		Is a DROP or RENAME of database dboid under way (see the file
 *		header)?  Then the launcher must not start a relay there.
 */
bool
outbox_database_blocked(Oid dboid)
{
	TimestampTz now = GetCurrentTimestamp();
	bool		blocked = false;
	int			i;

	SpinLockAcquire(&outbox_shared->mutex);
	for (i = 0; i < OUTBOX_MAX_BLOCKS; i++)
	{
		if (outbox_shared->blocked_db[i] == dboid &&
			outbox_shared->blocked_until[i] > now)
			blocked = true;
	}
	SpinLockRelease(&outbox_shared->mutex);
	return blocked;
}

static void
lifecycle_utility(PlannedStmt *pstmt, const char *queryString,
				  bool readOnlyTree, ProcessUtilityContext context,
				  ParamListInfo params, QueryEnvironment *queryEnv,
				  DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *stmt = pstmt->utilityStmt;
	Oid			release = InvalidOid;
	bool		ext_created = false;
	bool		wake = false;
	bool		counted = false;
	int64		pending = 0;
	int64		failed = 0;

	switch (nodeTag(stmt))
	{
		case T_DropdbStmt:
			release = releasable_database(((DropdbStmt *) stmt)->dbname);
			break;
		case T_RenameStmt:
			if (((RenameStmt *) stmt)->renameType == OBJECT_DATABASE)
				release = releasable_database(((RenameStmt *) stmt)->subname);
			break;
		case T_CreateExtensionStmt:
			ext_created = strcmp(((CreateExtensionStmt *) stmt)->extname,
								 OUTBOX_EXTENSION_NAME) == 0;
			break;
		case T_CreatedbStmt:
			/* CREATE DATABASE ... TEMPLATE d needs d to itself, too */
			release = releasable_database(option_value(((CreatedbStmt *) stmt)->options,
													   "template"));
			wake = true;
			break;
		case T_DropStmt:
			if (drops_outbox((DropStmt *) stmt))
			{
				lock_events_for_drop();
				counted = count_unpublished(&pending, &failed);
			}
			break;
		case T_AlterDatabaseStmt:
			/*
			 * Not released for SET TABLESPACE: movedb() commits in the
			 * middle, which would end the block too early.
			 */
			wake = true;
			break;
		default:
			break;
	}

	if (OidIsValid(release) && outbox_shared != NULL)
		release_database(release);

	if (prev_process_utility_hook)
		prev_process_utility_hook(pstmt, queryString, readOnlyTree,
								  context, params, queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context,
								params, queryEnv, dest, qc);

	/* only now: a DROP that fails (dependent objects) discards nothing */
	if (counted)
		warn_discarded(pending, failed);
	if (ext_created)
		created_in = MyDatabaseId;
	if (wake || ext_created)
		wake_at_commit = true;
	if ((wake || ext_created) && !callback_registered)
	{
		RegisterXactCallback(lifecycle_xact_callback, NULL);
		callback_registered = true;
	}
}

/*
 * The value of option name ("template") in a CREATE/ALTER DATABASE option
 * list, or NULL.
 */
static const char *
option_value(List *options, const char *name)
{
	ListCell   *lc;

	foreach(lc, options)
	{
		DefElem    *opt = lfirst(lc);

		if (strcmp(opt->defname, name) == 0 && opt->arg != NULL)
			return defGetString(opt);
	}
	return NULL;
}

/*
 * The OID of database name (NULL: none) if the current user may drop,
 * rename or copy it (superuser or owner) and it is not the current
 * database, else InvalidOid: core raises the error then, and the relays
 * stay.
 */
static Oid
releasable_database(const char *name)
{
	Oid			dboid;

	if (name == NULL)
		return InvalidOid;
	dboid = get_database_oid(name, true);

	if (!OidIsValid(dboid) || dboid == MyDatabaseId)
		return InvalidOid;
	if (!superuser() && !outbox_database_ownercheck(dboid, GetUserId()))
		return InvalidOid;
	return dboid;
}

/*
 * Block database dboid for the launcher, send its relays SIGTERM and wait
 * up to RELEASE_WAIT_MS for them to exit.  SIGTERM cuts a batch's wait for
 * Kafka short and marks what Kafka acknowledged (batch.c), so this takes a
 * fraction of a second.  Should no block entry be free, core's own wait
 * (5 s) still applies, and the launcher may start a relay again meanwhile.
 */
static void
release_database(Oid dboid)
{
	TimestampTz now = GetCurrentTimestamp();
	int			i;

	if (!callback_registered)
	{
		RegisterXactCallback(lifecycle_xact_callback, NULL);
		callback_registered = true;
	}

	SpinLockAcquire(&outbox_shared->mutex);
	for (i = 0; i < OUTBOX_MAX_BLOCKS && held_block < 0; i++)
	{
		if (outbox_shared->blocked_db[i] == InvalidOid ||
			outbox_shared->blocked_until[i] <= now)
		{
			outbox_shared->blocked_db[i] = dboid;
			outbox_shared->blocked_by[i] = MyProcPid;
			outbox_shared->blocked_until[i] =
				TimestampTzPlusMilliseconds(now, BLOCK_MAX_MS);
			held_block = i;
		}
	}
	SpinLockRelease(&outbox_shared->mutex);
	outbox_wake_launcher();

	outbox_stop_relays(dboid, RELEASE_WAIT_MS);
}

/*
 * At the end of a transaction that ran one of the statements above: tell
 * the launcher what committed, and end a block (whether the DROP or RENAME
 * committed or failed: the launcher then sees the outcome in pg_database).
 */
static void
lifecycle_xact_callback(XactEvent event, void *arg)
{
	bool		tell = false;

	if (event != XACT_EVENT_COMMIT && event != XACT_EVENT_ABORT &&
		event != XACT_EVENT_PREPARE)
		return;

	if (outbox_shared != NULL)
	{
		SpinLockAcquire(&outbox_shared->mutex);
		if (event == XACT_EVENT_COMMIT && OidIsValid(created_in))
		{
			if (outbox_shared->nevents < OUTBOX_MAX_EVENTS)
				outbox_shared->events[outbox_shared->nevents++] = created_in;
			else
				outbox_shared->events_overflow = true;
		}
		if (held_block >= 0 &&
			outbox_shared->blocked_by[held_block] == MyProcPid)
		{
			outbox_shared->blocked_db[held_block] = InvalidOid;
			outbox_shared->blocked_by[held_block] = 0;
			outbox_shared->blocked_until[held_block] = 0;
		}
		SpinLockRelease(&outbox_shared->mutex);
		tell = (event == XACT_EVENT_COMMIT && wake_at_commit) || held_block >= 0;
	}

	/* a relay waiting for the extension here (a list) need not poll for it */
	if (event == XACT_EVENT_COMMIT && OidIsValid(created_in))
		outbox_wake_worker(false);
	created_in = InvalidOid;
	wake_at_commit = false;
	held_block = -1;
	if (tell)
		outbox_wake_launcher();
}

/*
 * Does this DROP statement drop extension outbox, installed in this
 * database?
 */
static bool
drops_outbox(DropStmt *stmt)
{
	ListCell   *lc;

	if (stmt->removeType != OBJECT_EXTENSION)
		return false;
	foreach(lc, stmt->objects)
	{
		if (strcmp(strVal(lfirst(lc)), OUTBOX_EXTENSION_NAME) == 0)
			return OidIsValid(get_extension_oid(OUTBOX_EXTENSION_NAME, true));
	}
	return false;
}

/*
 * DROP EXTENSION outbox by its owner: take the lock the DROP will take on
 * outbox.events before the events are counted.  Counted first, an event
 * committed while the DROP waited for that lock (behind a session still
 * emitting) was dropped with the table and missing from the WARNING.  Only
 * for the extension's owner: anyone else's DROP fails, and must not hold
 * up emitting sessions on its way there.
 */
static void
lock_events_for_drop(void)
{
	Oid			extoid = get_extension_oid(OUTBOX_EXTENSION_NAME, true);
	Oid			nspoid = get_namespace_oid(OUTBOX_SCHEMA, true);
	Oid			relid;

	if (!OidIsValid(extoid) || !OidIsValid(nspoid) ||
		!outbox_extension_ownercheck(extoid, GetUserId()))
		return;
	relid = get_relname_relid(OUTBOX_EVENTS_TABLE, nspoid);
	if (OidIsValid(relid))
		LockRelationOid(relid, AccessExclusiveLock);
}

/*
 * The current database's events not published yet (*pending) and marked
 * failed (*failed), found as outbox.status finds them: row-tracked ones
 * through events_pending_idx, snapshot-tracked ones above the progress
 * floor or in a transaction its snapshot did not show as committed (in its
 * xip list, or at or above its xmax), each checked with
 * outbox.published(e); never a scan of the published rows retention keeps.
 * It runs in the DROP's session, under the caller's search_path: every
 * operator is qualified, so that none of the caller's own runs instead.
 * False (nothing counted) for a schema before 1.4 or a caller who may not
 * read the table: the count must never make the DROP fail.
 */
static bool
count_unpublished(int64 *pending, int64 *failed)
{
	bool		isnull;
	bool		done = false;

	SPI_connect();
	/*
	 * A snapshot taken now, after lock_events_for_drop(): the statement's own
	 * is older than the lock, and the transaction's (REPEATABLE READ) may be
	 * older still.
	 */
	PushActiveSnapshot(GetLatestSnapshot());
	/* by OID: a name that does not resolve gives NULL (false), not an error */
	if (SPI_execute("SELECT pg_catalog.has_table_privilege(pg_catalog.to_regclass('outbox.events'), 'SELECT')"
					"   AND pg_catalog.has_table_privilege(pg_catalog.to_regclass('outbox.relay_progress'), 'SELECT')"
					"   AND pg_catalog.has_function_privilege(pg_catalog.to_regprocedure('outbox.published(outbox.events)'), 'EXECUTE')",
					true, 1) == SPI_OK_SELECT &&
		DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0],
								   SPI_tuptable->tupdesc, 1, &isnull)) &&
		SPI_execute("WITH g AS ("
					"  SELECT p.snapshot, p.id_floor FROM outbox.relay_progress AS p"
					"   WHERE p.system_identifier OPERATOR(pg_catalog.=)"
					"         (SELECT c.system_identifier FROM pg_catalog.pg_control_system() AS c)"
					"   ORDER BY p.id_floor DESC LIMIT 1)"
					" SELECT pg_catalog.count(*) FILTER (WHERE u.failed_at IS NULL),"
					"        pg_catalog.count(*) FILTER (WHERE u.failed_at IS NOT NULL)"
					"   FROM (SELECT e.failed_at FROM outbox.events AS e"
					"          WHERE e.published_at IS NULL AND e.xid IS NULL"
					"         UNION ALL"
					"         SELECT NULL FROM outbox.events AS e"
					"          WHERE e.xid IS NOT NULL"
					"            AND e.id OPERATOR(pg_catalog.>) COALESCE((SELECT g.id_floor FROM g), 0)"
					"            AND NOT outbox.published(e)"
					"         UNION ALL"
					"         SELECT NULL FROM g"
					"           CROSS JOIN pg_catalog.pg_snapshot_xip(g.snapshot) AS x(xid)"
					"           JOIN outbox.events AS e ON e.xid OPERATOR(pg_catalog.=) x.xid"
					"                                  AND e.id OPERATOR(pg_catalog.<=) g.id_floor"
					"          WHERE NOT outbox.published(e)"
					"         UNION ALL"
					"         SELECT NULL FROM g"
					"           JOIN outbox.events AS e"
					"             ON e.xid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(g.snapshot)"
					"            AND e.id OPERATOR(pg_catalog.<=) g.id_floor"
					"          WHERE NOT outbox.published(e)) AS u",
					true, 1) == SPI_OK_SELECT)
	{
		*pending = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull));
		*failed = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
											  SPI_tuptable->tupdesc, 2, &isnull));
		done = true;
	}
	PopActiveSnapshot();
	SPI_finish();
	return done;
}

/*
 * The WARNING after DROP EXTENSION outbox dropped events that never
 * reached Kafka (nothing if there were none).
 */
static void
warn_discarded(int64 pending, int64 failed)
{
	if (pending == 0 && failed == 0)
		return;
	ereport(WARNING,
			(errmsg_plural("DROP EXTENSION outbox discarded " INT64_FORMAT " event never published to Kafka",
						   "DROP EXTENSION outbox discarded " INT64_FORMAT " events never published to Kafka",
						   (unsigned long) (pending + failed), pending + failed),
			 failed > 0 ?
			 errdetail("They were rows of outbox.events, which is dropped with the extension; " INT64_FORMAT " of them were marked failed.",
					   failed) :
			 errdetail("They were rows of outbox.events, which is dropped with the extension."),
			 errhint("Inside a transaction block, ROLLBACK keeps them.  Before dropping the extension, wait until outbox.status shows pending = 0, and retry (outbox.retry_failed()) or save the failed events.")));
}

/*-------------------------------------------------------------------------
 *
 * connect.c
 *	  The relay worker's connection to outbox.database, as outbox.role.
 *
 * A worker that cannot connect exits with FATAL and is restarted by the
 * postmaster.  When the database does not exist (yet), that would be a
 * FATAL every few seconds: the next worker waits instead, connected to no
 * database, reading the shared catalogs until the database and the role
 * are there, and shows what it waits for in outbox.status.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "connect.h"
#include "status.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_authid.h"
#include "catalog/pg_database.h"
#include "miscadmin.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "utils/fmgroids.h"
#include "utils/memutils.h"
#include "utils/rel.h"

pg_noreturn static void wait_for_database(void);
static const char *connection_obstacle(void);
static HeapTuple shared_catalog_row(Oid relid, Oid name_index,
									AttrNumber name_attnum, const char *name);

/*
 * outbox_connect_to_database
 *		Connect the relay worker to outbox.database as outbox.role (the
 *		bootstrap superuser when empty).  Called once, at worker start.
 *
 * If the previous attempt failed (the flag in shared memory is still set),
 * the database probably does not exist: then wait for it without a database
 * connection instead of failing again every few seconds.  That wait never
 * returns: it ends the process with exit code 1 once the connection can be
 * made, and the postmaster starts a worker that makes it.  A refused
 * connection is raised as FATAL by BackgroundWorkerInitializeConnection.
 */
void
outbox_connect_to_database(void)
{
	bool		missing = false;

	if (outbox_shared != NULL)
	{
		SpinLockAcquire(&outbox_shared->mutex);
		missing = outbox_shared->database_missing;
		outbox_shared->database_missing = true;
		SpinLockRelease(&outbox_shared->mutex);
	}
	if (missing)
		wait_for_database();

	/* a FATAL error here leaves database_missing set for the next start */
	BackgroundWorkerInitializeConnection(outbox_database,
										 outbox_role[0] != '\0' ? outbox_role : NULL,
										 0);

	if (outbox_shared != NULL)
	{
		SpinLockAcquire(&outbox_shared->mutex);
		outbox_shared->database_missing = false;
		SpinLockRelease(&outbox_shared->mutex);
	}
}

/*
 * Wait, connected to no database, until outbox.database (and outbox.role,
 * if set) exist; then exit so that the postmaster starts a worker that
 * connects to them.  A connection refused for another reason (e.g. the role
 * may not log in) is retried every few seconds, each time with its FATAL
 * message, which says why.
 */
static void
wait_for_database(void)
{
	char	   *logged = NULL;

	BackgroundWorkerInitializeConnection(NULL, NULL, 0);
	outbox_shared_register_worker();
	outbox_enter_state(OUTBOX_STATE_WAITING_FOR_DATABASE, NULL);

	for (;;)
	{
		const char *obstacle;

		CHECK_FOR_INTERRUPTS();
		StartTransactionCommand();
		obstacle = connection_obstacle();
		if (obstacle != NULL)
			obstacle = MemoryContextStrdup(TopMemoryContext, obstacle);
		CommitTransactionCommand();

		if (obstacle == NULL)
		{
			SpinLockAcquire(&outbox_shared->mutex);
			outbox_shared->database_missing = false;
			SpinLockRelease(&outbox_shared->mutex);
			ereport(LOG,
					(errmsg("outbox relay can connect to database \"%s\" now, restarting to connect to it",
							outbox_database)));
			proc_exit(1);
		}

		/* log each new obstacle once; the status always shows the current one */
		outbox_status_set_error(obstacle);
		if (logged == NULL || strcmp(logged, obstacle) != 0)
		{
			ereport(LOG,
					(errmsg("outbox relay is waiting: %s", obstacle),
					 errdetail("It connects to database \"%s\"%s%s%s.", outbox_database,
							   outbox_role[0] != '\0' ? " as role \"" : "",
							   outbox_role, outbox_role[0] != '\0' ? "\"" : ""),
					 errhint("Create the database, or the role with LOGIN, or change outbox.database or outbox.role and restart the server.")));
			if (logged != NULL)
				pfree(logged);
			logged = (char *) obstacle;
		}
		else
			pfree((char *) obstacle);
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 Max(outbox_poll_interval, 1000),
						 outbox_wait_event(OUTBOX_WAIT_DATABASE));
		ResetLatch(MyLatch);
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			outbox_reload_config_file();
		}
	}
}

/*
 * What keeps the relay from connecting to outbox.database as outbox.role,
 * in words for the log and outbox.status, or NULL if nothing does.  The
 * database must exist and accept connections (datallowconn is off e.g.
 * while a restore loads it); the role must exist and have LOGIN, which a
 * background worker's connection needs as much as a client's.  Call in a
 * transaction.
 */
static const char *
connection_obstacle(void)
{
	HeapTuple	tuple;

	tuple = shared_catalog_row(DatabaseRelationId, DatabaseNameIndexId,
							   Anum_pg_database_datname, outbox_database);
	if (tuple == NULL)
		return psprintf("database \"%s\" does not exist", outbox_database);
	if (!((Form_pg_database) GETSTRUCT(tuple))->datallowconn)
		return psprintf("database \"%s\" does not accept connections", outbox_database);
	if (outbox_role[0] == '\0')
		return NULL;

	tuple = shared_catalog_row(AuthIdRelationId, AuthIdRolnameIndexId,
							   Anum_pg_authid_rolname, outbox_role);
	if (tuple == NULL)
		return psprintf("role \"%s\" (outbox.role) does not exist", outbox_role);
	if (!((Form_pg_authid) GETSTRUCT(tuple))->rolcanlogin)
		return psprintf("role \"%s\" (outbox.role) is not permitted to log in", outbox_role);
	return NULL;
}

/*
 * The row of a shared catalog (pg_database, pg_authid) whose name column
 * equals name, copied, or NULL.  A worker without a database connection
 * can read shared catalogs, but only their heaps: the relcache entries of
 * their indexes may have to be read from pg_class, which needs a database
 * ("cannot read pg_class without having selected a database"), until some
 * backend has written the shared relcache init file.  Call in a
 * transaction.
 */
static HeapTuple
shared_catalog_row(Oid relid, Oid name_index, AttrNumber name_attnum,
				   const char *name)
{
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData key;
	HeapTuple	tuple;

	rel = table_open(relid, AccessShareLock);
	ScanKeyInit(&key, name_attnum, BTEqualStrategyNumber, F_NAMEEQ,
				CStringGetDatum(name));
	scan = systable_beginscan(rel, name_index, false, NULL, 1, &key);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
		tuple = heap_copytuple(tuple);
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return tuple;
}

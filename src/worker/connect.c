/*-------------------------------------------------------------------------
 *
 * connect.c
 *	  A relay worker's connection to its database, as outbox.role.
 *
 * The launcher (launcher.c), connected to no database, reads the shared
 * catalogs to see whether a relay could connect; while it could not (the
 * database or the role does not exist yet), the launcher waits instead of
 * starting a relay that fails, and shows what it waits for in
 * outbox.status.  The relay then connects by the database's OID, and
 * checks that the database has the extension before it serves it.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "worker/connect.h"
#include "config/dblist.h"
#include "config/guc.h"
#include "shared/partition.h"
#include "shared/shmem.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_authid.h"
#include "catalog/pg_database.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "utils/fmgroids.h"
#include "utils/memutils.h"
#include "utils/rel.h"

static HeapTuple shared_catalog_row(Oid relid, Oid name_index,
									AttrNumber name_attnum, const char *name);

/*
 * outbox_connect_to_database
 *		Connect the relay worker to the database the launcher gave it in
 *		bgw_extra (an OutboxRelayArgs: by OID, so a rename in between does
 *		not matter), as outbox.role (the bootstrap superuser when empty).
 *		Called once, at worker start.
 *
 * The launcher checked that the database and the role can be used
 * (outbox_connection_obstacle); a connection refused anyway (dropped since,
 * no CONNECT privilege) is raised as FATAL by
 * BackgroundWorkerInitializeConnectionByOid, and the launcher starts the
 * relay again later, with a growing delay.
 */
void
outbox_connect_to_database(void)
{
	OutboxRelayArgs args;

	memcpy(&args, MyBgworkerEntry->bgw_extra, sizeof(args));
	outbox_relay_database = MemoryContextStrdup(TopMemoryContext, args.dbname);
	outbox_relay_worker = args.worker;
	outbox_relay_nworkers = Max(args.nworkers, 1);
	BackgroundWorkerInitializeConnectionByOid(args.dboid, args.roleoid, 0);
}

/*
 * outbox_connection_obstacle
 *		What keeps a relay from connecting to database dbname as
 *		outbox.role, in words for the log and outbox.status, or NULL if
 *		nothing does.  db is its pg_database row (outbox_scan_databases), or
 *		NULL if there is none.  The database must exist, accept connections
 *		(datallowconn is off e.g. while a restore loads it) and not be a
 *		template; the role must exist and have LOGIN, which a background
 *		worker's connection needs as much as a client's.  *roleoid is set to
 *		the role's OID (InvalidOid for the bootstrap superuser).  Call in a
 *		transaction; the result is palloc'd.
 */
const char *
outbox_connection_obstacle(const char *dbname, const OutboxDatabase *db,
						   Oid *roleoid)
{
	HeapTuple	tuple;

	*roleoid = InvalidOid;
	if (db == NULL)
		return psprintf("database \"%s\" does not exist", dbname);
	if (!db->allow_connections)
		return psprintf("database \"%s\" does not accept connections", dbname);
	if (db->is_template)
		return psprintf("database \"%s\" is a template", dbname);
	if (outbox_role[0] == '\0')
		return NULL;

	tuple = shared_catalog_row(AuthIdRelationId, AuthIdRolnameIndexId,
							   Anum_pg_authid_rolname, outbox_role);
	if (tuple == NULL)
		return psprintf("role \"%s\" (outbox.role) does not exist", outbox_role);
	if (!((Form_pg_authid) GETSTRUCT(tuple))->rolcanlogin)
		return psprintf("role \"%s\" (outbox.role) is not permitted to log in", outbox_role);
	*roleoid = ((Form_pg_authid) GETSTRUCT(tuple))->oid;
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

/*
 * outbox_relay_has_extension
 *		Does the relay's database have the extension?  Always true unless
 *		outbox.databases is '*': only then does its absence end the relay
 *		(see outbox_exit_without_extension); otherwise the relay waits for
 *		it in its loop.  Runs its own transaction: call it between batches.
 */
bool
outbox_relay_has_extension(void)
{
	bool		found;

	if (strcmp(outbox_databases, "*") != 0)
		return true;
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	found = OidIsValid(get_extension_oid(OUTBOX_EXTENSION_NAME, true));
	CommitTransactionCommand();
	return found;
}

/*
 * outbox_exit_without_extension
 *		With outbox.databases = '*', a database without the extension has
 *		no relay: say so in the slot, so that the launcher does not start
 *		one again until CREATE EXTENSION outbox commits there (lifecycle.c),
 *		and exit with code 0.  dropped: the relay had found the extension,
 *		which is gone now (logged); otherwise it only looked (in every
 *		database without the extension at each launcher start: DEBUG1).
 */
void
outbox_exit_without_extension(bool dropped)
{
	ereport(dropped ? LOG : DEBUG1,
			(errmsg("outbox relay for database \"%s\" exits: the database has no extension outbox",
					outbox_relay_database),
			 errdetail("outbox.databases is \"*\"; the relay starts again after CREATE EXTENSION outbox there.")));
	SpinLockAcquire(&outbox_my_slot->mutex);
	outbox_my_slot->extension_absent = true;
	SpinLockRelease(&outbox_my_slot->mutex);
	proc_exit(0);
}

/*-------------------------------------------------------------------------
 *
 * relay_xact.c
 *	  The frame of one relay transaction, the shape of worker_spi's: a
 *	  statement start, a transaction, SPI, a snapshot and the activity shown
 *	  in pg_stat_activity, then the same taken down in reverse.  The relay
 *	  batch (batch.c) and retention (retention.c) each run in one.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/relay_xact.h"

#include "access/xact.h"
#include "catalog/dependency.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_extension.h"
#include "commands/extension.h"
#include "nodes/makefuncs.h"
#include "pgstat.h"
#include "storage/lmgr.h"
#include "utils/snapmgr.h"

/*
 * outbox_relay_xact_begin
 *		Start a transaction, connect to SPI, push a snapshot and show
 *		activity in pg_stat_activity.
 *
 * Returns the memory context that was current before, for
 * outbox_relay_xact_end.  Raises ERROR if SPI_connect fails.
 */
MemoryContext
outbox_relay_xact_begin(const char *activity)
{
	MemoryContext callercxt = CurrentMemoryContext;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, activity);
	return callercxt;
}

/*
 * outbox_relay_xact_end
 *		Finish SPI, pop the snapshot and commit what outbox_relay_xact_begin
 *		started; report statistics if report_stats, show the process idle,
 *		and return to callercxt.
 *
 * Errors of the commit are raised as ERROR.
 */
void
outbox_relay_xact_end(MemoryContext callercxt, bool report_stats)
{
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	if (report_stats)
		pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	MemoryContextSwitchTo(callercxt);
}

/*
 * outbox_lock_events_table
 *		Lock the extension and outbox.events against a concurrent DROP for
 *		the rest of the transaction and return the table's OID, or
 *		InvalidOid if there is no extension or the table is not its own.
 *
 * The extension is locked first: DROP EXTENSION locks it before any of its
 * objects, so a relay batch and a DROP then queue on that one lock instead
 * of each taking a member (the table, the id sequence, relay_progress) the
 * other waits for, a deadlock that cost the DROP its transaction.
 * RangeVarGetRelidExtended re-checks after locking, so a table dropped
 * meanwhile is not "found".
 */
Oid
outbox_lock_events_table(void)
{
	RangeVar   *rv = makeRangeVar(OUTBOX_SCHEMA, OUTBOX_EVENTS_TABLE, -1);
	Oid			extension = get_extension_oid(OUTBOX_EXTENSION_NAME, true);
	Oid			relid;

	/*
	 * Only the extension's own table counts.  Without the extension, anyone
	 * who may create a schema in the database (its owner, say) could make an
	 * "outbox.events" with a trigger, and the relay, often a superuser,
	 * would run that trigger's code when it marks or deletes events.
	 */
	if (!OidIsValid(extension))
		return InvalidOid;
	LockDatabaseObject(ExtensionRelationId, extension, 0, AccessShareLock);
	relid = RangeVarGetRelidExtended(rv, RowExclusiveLock, RVR_MISSING_OK,
									 NULL, NULL);
	if (OidIsValid(relid) &&
		getExtensionOfObject(RelationRelationId, relid) != extension)
		return InvalidOid;
	return relid;
}

/*
 * outbox_prepare_plan
 *		The saved plan in *cache, prepared from sql on first use in this
 *		process and kept for its lifetime.
 *
 * Raises ERROR if SPI_prepare fails.
 */
SPIPlanPtr
outbox_prepare_plan(SPIPlanPtr *cache, const char *sql, int nargs, Oid *argtypes)
{
	if (*cache == NULL)
	{
		SPIPlanPtr	plan = SPI_prepare(sql, nargs, argtypes);

		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed for \"%s\": %s", sql,
				 SPI_result_code_string(SPI_result));
		SPI_keepplan(plan);
		*cache = plan;
	}
	return *cache;
}

/*
 * outbox_prepare_bytes_plan
 *		outbox_prepare_plan of format with its one %s replaced by the claims'
 *		payload_bytes column (COL_PAYLOAD_BYTES: the column from schema 1.6 on,
 *		else NULL::bytea); the text is built only when the plan is prepared.
 *		Raises ERROR if SPI_prepare fails.
 */
SPIPlanPtr
outbox_prepare_bytes_plan(SPIPlanPtr *cache, const char *format, bool bytes,
						  int nargs, Oid *argtypes)
{
	if (*cache == NULL)
		(void) outbox_prepare_plan(cache,
								   psprintf(format, bytes ? "e.payload_bytes" : "NULL::bytea"),
								   nargs, argtypes);
	return *cache;
}

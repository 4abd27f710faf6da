/*-------------------------------------------------------------------------
 *
 * vacuum.c
 *	  VACUUM of outbox.events soon after the retention deleted rows, in a
 *	  short-lived background worker of its own.
 *
 * The retention deletes published events (retention.c, mark.c); their space
 * is reused only once VACUUM has recorded it in the free space map.  Until
 * then every new event extends the table.  Autovacuum visits a database once
 * per autovacuum_naptime (1 min by default), and at 20,000 events/s the relay
 * deletes 1,200,000 rows in that minute: measured, the table grew to 3
 * times the rows it keeps.  So the relay starts a VACUUM of the table itself
 * once outbox.vacuum_interval (5 s; 0 leaves the table to autovacuum) has
 * passed and enough rows were deleted.  It runs in its own process, on
 * another core, so publishing never waits for it, and with SKIP_LOCKED, so
 * it steps aside when autovacuum (or a user's VACUUM) is already at the
 * table.  Autovacuum stays on for the table: it
 * still protects it from transaction id wraparound.
 *
 * The relay side (outbox_vacuum_*) runs in the relay process, between
 * batches; outbox_vacuum_main is the worker's entry point.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/vacuum.h"
#include "config/guc.h"
#include "relay/fault_point.h"
#include "relay/relay_xact.h"
#include "shared/bgworker.h"
#include "shared/shmem.h"

#include "access/xact.h"
#include "commands/vacuum.h"
#include "nodes/makefuncs.h"
#include "parser/parse_node.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "storage/ipc.h"
#include "storage/proc.h"
#include "storage/spin.h"
#include "tcop/tcopprot.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/*
 * Fewest deleted rows worth a VACUUM: the autovacuum threshold the table
 * carries (autovacuum_vacuum_threshold = 10000 in sql/outbox.sql).
 */
#define VACUUM_MIN_DELETED_ROWS	10000

/*
 * Fewest deleted rows worth a VACUUM once deleting has stopped for a pass
 * (a "wave" ended): the retention deletes a burst over several passes, in
 * row mode as the burst's rows reach their age one batch after another, and
 * the tail deleted after the last VACUUM would otherwise wait for 10,000
 * more deletes or for autovacuum.  Below this, a trickle of events would
 * start a VACUUM every interval for a handful of rows.
 */
#define VACUUM_MIN_WAVE_ROWS	1000

/* relay side: rows deleted since the last VACUUM started, and that worker */
static int64 deleted_since_vacuum = 0;
/* deleted_since_vacuum at the previous outbox_vacuum_if_due call */
static int64 deleted_at_last_check = 0;
static TimestampTz last_vacuum_start = 0;
static BackgroundWorkerHandle *vacuum_handle = NULL;

/* the VACUUM worker's relay slot, where it shows its pid; NULL if none */
static OutboxRelaySlot *vacuum_slot = NULL;

static void register_in_slot(Oid dboid);
static void unregister_from_slot(int code, Datum arg);

/* no worker slot was free at the last try (logged once until one is) */
static bool vacuum_slot_missing = false;

/*
 * outbox_vacuum_count_deleted
 *		Count rows the relay deleted from outbox.events (any number >= 0), so
 *		that outbox_vacuum_if_due knows when a VACUUM is worth it.  Raises no
 *		error.
 */
void
outbox_vacuum_count_deleted(int64 rows)
{
	deleted_since_vacuum += rows;
}

/*
 * Is the VACUUM started last still running (or not yet started)?  Forgets
 * its handle once it has stopped.
 */
static bool
vacuum_running(void)
{
	pid_t		pid;

	if (vacuum_handle == NULL)
		return false;
	if (GetBackgroundWorkerPid(vacuum_handle, &pid) != BGWH_STOPPED)
		return true;
	pfree(vacuum_handle);
	vacuum_handle = NULL;
	return false;
}

/*
 * Register the VACUUM worker for this database; false when no background
 * worker slot is free (max_worker_processes).
 */
static bool
start_vacuum_worker(void)
{
	BackgroundWorker worker;
	MemoryContext oldcxt;
	bool		started;
	int			slot;

	outbox_init_bgworker(&worker, "outbox_vacuum_main", "outbox vacuum",
						 BGW_NEVER_RESTART);
	worker.bgw_main_arg = ObjectIdGetDatum(MyDatabaseId);
	/* the relay's slot, where the worker shows its pid (register_in_slot) */
	slot = outbox_my_slot != NULL ? (int) (outbox_my_slot - outbox_shared->slots) : -1;
	memcpy(worker.bgw_extra, &slot, sizeof(slot));

	/* the handle outlives the relay's transactions and batches */
	oldcxt = MemoryContextSwitchTo(TopMemoryContext);
	started = RegisterDynamicBackgroundWorker(&worker, &vacuum_handle);
	MemoryContextSwitchTo(oldcxt);
	return started;
}

/*
 * Are the rows deleted since the last VACUUM worth one now: many, or the
 * tail of a wave of deletes (nothing deleted since the previous call)?
 */
static bool
enough_deleted(void)
{
	bool		wave_ended = deleted_since_vacuum == deleted_at_last_check;

	deleted_at_last_check = deleted_since_vacuum;
	return deleted_since_vacuum >= VACUUM_MIN_DELETED_ROWS ||
		(wave_ended && deleted_since_vacuum >= VACUUM_MIN_WAVE_ROWS);
}

/*
 * outbox_vacuum_if_due
 *		Start a VACUUM of outbox.events in a background worker when
 *		outbox.vacuum_interval (s; 0 = never, autovacuum alone) has passed
 *		since the last one started, the last one has finished, and since it
 *		started at least VACUUM_MIN_DELETED_ROWS rows were deleted, or at
 *		least VACUUM_MIN_WAVE_ROWS and none since the previous call (the
 *		retention calls this once per pass, every second).  Called by the
 *		relay between batches, outside a transaction.
 *
 * Raises no error: when no background worker slot is free, one LOG line
 * says so (until a slot is found again) and autovacuum alone keeps the
 * table, as with outbox.vacuum_interval = 0.
 */
void
outbox_vacuum_if_due(void)
{
	TimestampTz now;

	if (outbox_vacuum_interval <= 0 || !enough_deleted())
		return;
	now = GetCurrentTimestamp();
	if (!TimestampDifferenceExceeds(last_vacuum_start, now,
									outbox_vacuum_interval * 1000) ||
		vacuum_running())
		return;

	last_vacuum_start = now;
	if (!start_vacuum_worker())
	{
		if (!vacuum_slot_missing)
			ereport(LOG,
					(errmsg("outbox relay could not start a VACUUM of outbox.events: no background worker slot is free"),
					 errdetail("Autovacuum alone reuses the space of deleted events until a slot is free."),
					 errhint("Raise max_worker_processes, or set outbox.vacuum_interval = 0.")));
		vacuum_slot_missing = true;
		return;
	}
	vacuum_slot_missing = false;
	deleted_since_vacuum = 0;
	deleted_at_last_check = 0;
	elog(DEBUG1, "outbox relay started a VACUUM of outbox.events");
}

/*
 * The VACUUM statement for relid: VACUUM (SKIP_LOCKED) on the table's OID,
 * as autovacuum names its tables, so that a table dropped meanwhile is
 * skipped quietly.
 */
static VacuumStmt *
make_vacuum_stmt(Oid relid)
{
	VacuumStmt *stmt = makeNode(VacuumStmt);

	stmt->options = list_make1(makeDefElem("skip_locked", NULL, -1));
	stmt->rels = list_make1(makeVacuumRelation(NULL, relid, NIL));
	stmt->is_vacuumcmd = true;
	return stmt;
}

/*
 * Show this worker's pid in its relay's slot (vacuum_pid) until it exits,
 * before it connects: DROP DATABASE, RENAME and TEMPLATE stop a database's
 * relays through their slots (outbox_stop_relays) and must stop this
 * worker too, whose connection would make them fail.  The slot is the one
 * the relay had when it started the worker (bgw_extra); if it serves
 * another database by now, nothing is shown.
 */
static void
register_in_slot(Oid dboid)
{
	int			slot;
	OutboxRelaySlot *s;

	memcpy(&slot, MyBgworkerEntry->bgw_extra, sizeof(slot));
	if (slot < 0 || slot >= outbox_shared->nslots)
		return;
	s = &outbox_shared->slots[slot];
	SpinLockAcquire(&s->mutex);
	if (s->in_use && s->database_oid == dboid)
	{
		s->vacuum_pid = MyProcPid;
		vacuum_slot = s;
	}
	SpinLockRelease(&s->mutex);
	if (vacuum_slot != NULL)
		on_shmem_exit(unregister_from_slot, (Datum) 0);
}

/* clear vacuum_pid at exit, if it is still ours */
static void
unregister_from_slot(int code, Datum arg)
{
	SpinLockAcquire(&vacuum_slot->mutex);
	if (vacuum_slot->vacuum_pid == MyProcPid)
		vacuum_slot->vacuum_pid = 0;
	SpinLockRelease(&vacuum_slot->mutex);
}

/*
 * outbox_vacuum_main
 *		Entry point of the VACUUM worker (main_arg: the database OID).
 *		Connects as the bootstrap superuser (VACUUM needs the table's owner
 *		or MAINTAIN; it runs index work as the table's owner itself), runs
 *		VACUUM (SKIP_LOCKED) outbox.events once and exits.  A database
 *		without the extension (dropped meanwhile), or whose outbox.events is
 *		not the extension's own (outbox_lock_events_table decides, as for
 *		the relay; its locks end when VACUUM commits the transaction before
 *		its own), is left alone.  Errors
 *		end the worker with the server's usual ERROR log line; the relay
 *		starts another one later.
 */
void
outbox_vacuum_main(Datum main_arg)
{
	Oid			relid;

	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	register_in_slot(DatumGetObjectId(main_arg));
	BackgroundWorkerInitializeConnectionByOid(DatumGetObjectId(main_arg),
											  InvalidOid, 0);
	/* a test hook: connected, nothing vacuumed yet */
	outbox_fault_point("vacuum_start");

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	/* the relay's own test of "the extension's outbox.events" (relay_xact.c) */
	relid = outbox_lock_events_table();
	if (OidIsValid(relid))
	{
		pgstat_report_activity(STATE_RUNNING, "VACUUM (SKIP_LOCKED) outbox.events");
		/* commits and starts transactions itself, as for a client's VACUUM */
		ExecVacuum(make_parsestate(NULL), make_vacuum_stmt(relid), true);
	}
	CommitTransactionCommand();
	pgstat_report_activity(STATE_IDLE, NULL);
	proc_exit(0);
}

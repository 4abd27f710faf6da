/*-------------------------------------------------------------------------
 *
 * launcher.c
 *	  The launcher: a background worker, connected to no database, that
 *	  keeps one relay running for each database that should have one.
 *
 * Registered by _PG_init under shared_preload_libraries.  Like the
 * autovacuum launcher it reads only shared catalogs (pg_database,
 * pg_authid), so it never holds a connection that would block DROP or
 * RENAME of a database.  Each pass it reaps relays that exited (we are
 * their bgw_notify_pid, so the postmaster sets our latch) and delays their
 * restart (RELAY_BACKOFF_MIN_MS doubling up to RELAY_BACKOFF_MAX_MS); reads
 * pg_database and works out the covered databases (outbox.databases,
 * dblist.c); stops relays of databases no longer covered or being dropped
 * or renamed (lifecycle.c); and starts the missing relays as dynamic
 * background workers, each in a slot of shared memory (outbox.max_workers
 * of them).  Databases beyond that are logged once, by name, and unserved.
 *
 * With '*', whether a database has the extension is seen only from inside
 * it: the launcher starts a relay in every database that accepts
 * connections and is not a template; a relay that finds no extension says
 * so in its slot and exits with code 0 (worker.c).  The launcher then
 * starts none there until CREATE EXTENSION outbox commits in it (the hook
 * of lifecycle.c sets our latch) or ABSENT_REPROBE_MS passed.  With a list
 * (or '' and outbox.database, the 1.x setting), a database without the
 * extension keeps its relay, which waits for it as in 1.x; a database that
 * does not exist or cannot be connected to is waited for by the launcher
 * itself, which shows state waiting_for_database in outbox.status.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "connect.h"
#include "dblist.h"
#include "lifecycle.h"
#include "status.h"

#include "access/xact.h"
#include "lib/stringinfo.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "tcop/tcopprot.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

/* pg_database is read again at least this often (ms) ... */
#define LAUNCHER_NAP_MS				10000
/* ... and this often while something waits (a database, a slot, a delay) */
#define LAUNCHER_BUSY_NAP_MS		1000
/* delay before a relay that exited unexpectedly is started again */
#define RELAY_BACKOFF_MIN_MS		1000
#define RELAY_BACKOFF_MAX_MS		60000
/* a relay that ran this long before exiting starts its backoff afresh */
#define RELAY_STABLE_MS				60000
/* '*': a database without the extension is probed again after this long */
#define ABSENT_REPROBE_MS			(5 * 60 * 1000)
/* how long a new launcher waits for the relays of its predecessor to exit */
#define PREDECESSOR_WAIT_MS			10000

/* what the launcher knows of one covered (or lately covered) database */
typedef struct LauncherDb
{
	char		name[NAMEDATALEN];	/* hash key */
	Oid			dboid;			/* InvalidOid while it does not exist */
	Oid			roleoid;		/* outbox.role, resolved */
	bool		wanted;			/* covered at the last pass */
	char	   *obstacle;		/* why no relay can connect, or NULL */
	char	   *logged_obstacle;	/* the last one logged */
	int			slot;			/* index in outbox_shared->slots, or -1 */
	BackgroundWorkerHandle *handle; /* its relay, while one runs */
	bool		stopping;		/* we terminated it: no restart delay */
	bool		absent;			/* '*': no extension there */
	bool		created;		/* CREATE EXTENSION committed since the start */
	TimestampTz absent_at;
	TimestampTz started_at;
	TimestampTz start_after;	/* restart delay */
	int			failures;		/* unexpected exits in a row */
	TimestampTz unserved_since; /* no slot for it since; 0: served */
	bool		no_bgworker;	/* why: max_worker_processes, not max_workers */
} LauncherDb;

static HTAB *databases = NULL;
static MemoryContext pass_context = NULL;
static bool bgw_slots_exhausted = false;

static void launcher_shutdown(int code, Datum arg);
static long launcher_pass(void);
static void take_events(void);
static void reap_relays(TimestampTz now);
static List *plan_databases(bool *all);
static void set_target(LauncherDb *db, const OutboxDatabase *row);
static void stop_relay(LauncherDb *db);
static bool start_relay(LauncherDb *db, TimestampTz now);
static int	take_slot(LauncherDb *db);
static void free_slot(LauncherDb *db);
static bool free_waiting_slot(void);
static void report_unserved(LauncherDb **unserved, int count);

/*
 * outbox_launcher_main
 *		Entry point of the launcher, named in its registration; main_arg is
 *		unused.  Never returns: the loop ends with the process, by SIGTERM
 *		(FATAL at CHECK_FOR_INTERRUPTS) or postmaster death.  An ERROR ends
 *		it too; its relays are stopped on the way out (launcher_shutdown)
 *		and the postmaster starts a new launcher after
 *		LAUNCHER_RESTART_SECONDS.
 */
void
outbox_launcher_main(Datum main_arg)
{
	HASHCTL		ctl;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	/* shared catalogs only: no database to hold on to */
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);

	memset(&ctl, 0, sizeof(ctl));
	ctl.keysize = NAMEDATALEN;
	ctl.entrysize = sizeof(LauncherDb);
	databases = hash_create("outbox launcher databases", 64, &ctl,
							HASH_ELEM | HASH_STRINGS);
	pass_context = AllocSetContextCreate(TopMemoryContext, "outbox launcher",
										 ALLOCSET_DEFAULT_SIZES);

	outbox_shared_register_launcher(PREDECESSOR_WAIT_MS);
	before_shmem_exit(launcher_shutdown, (Datum) 0);
	ereport(LOG, (errmsg("outbox launcher started")));

	for (;;)
	{
		long		nap;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			outbox_reload_config_file();
		}
		MemoryContextReset(pass_context);
		MemoryContextSwitchTo(pass_context);
		nap = launcher_pass();
		MemoryContextSwitchTo(TopMemoryContext);

		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 nap, outbox_wait_event(OUTBOX_WAIT_IDLE));
		ResetLatch(MyLatch);
	}
}

/*
 * before_shmem_exit callback: stop our relays (a new launcher starts them
 * again), free the slots we hold ourselves, and unpublish our latch.
 */
static void
launcher_shutdown(int code, Datum arg)
{
	HASH_SEQ_STATUS seq;
	LauncherDb *db;

	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		if (db->handle != NULL)
			TerminateBackgroundWorker(db->handle);
		else if (db->slot >= 0)
			free_slot(db);
	}
	SpinLockAcquire(&outbox_shared->mutex);
	outbox_shared->launcher_pid = 0;
	outbox_shared->launcher_latch = NULL;
	outbox_shared->nunserved = 0;
	SpinLockRelease(&outbox_shared->mutex);
}

/* db takes a free slot (-1: none free), or gives its slot back */
static int
take_slot(LauncherDb *db)
{
	return db->slot = outbox_slot_take(db->dboid, db->name);
}
static void
free_slot(LauncherDb *db)
{
	if (db->slot >= 0)
		outbox_slot_free(db->slot);
	db->slot = -1;
}

/*
 * Free a slot the launcher holds only to show a database it waits for
 * (waiting_for_database): a relay that can run needs it more.  False if
 * there is none.
 */
static bool
free_waiting_slot(void)
{
	HASH_SEQ_STATUS seq;
	LauncherDb *db;

	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		if (db->obstacle != NULL && db->slot >= 0 && db->handle == NULL)
		{
			free_slot(db);
			hash_seq_term(&seq);
			return true;
		}
	}
	return false;
}

/*
 * One pass (see the file header).  Returns how long to sleep (ms) unless
 * the latch is set earlier.
 */
static long
launcher_pass(void)
{
	TimestampTz now = GetCurrentTimestamp();
	long		nap = LAUNCHER_NAP_MS;
	bool		all;
	List	   *covered;
	ListCell   *lc;
	HASH_SEQ_STATUS seq;
	LauncherDb *db;
	LauncherDb **unserved;
	int			nunserved = 0;

	take_events();
	reap_relays(now);
	covered = plan_databases(&all);

	/* stop what is no longer covered, or is being dropped or renamed */
	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		if (db->wanted && !(OidIsValid(db->dboid) && outbox_database_blocked(db->dboid)))
			continue;
		if (db->handle != NULL)
			stop_relay(db);
		else
		{
			if (db->slot >= 0)
				free_slot(db);
			if (!db->wanted)
			{
				if (db->obstacle)
					pfree(db->obstacle);
				if (db->logged_obstacle)
					pfree(db->logged_obstacle);
				(void) hash_search(databases, db->name, HASH_REMOVE, NULL);
			}
		}
	}

	/* start what is missing, in the order of outbox.databases (or OID) */
	unserved = palloc(sizeof(LauncherDb *) * Max(list_length(covered), 1));
	foreach(lc, covered)
	{
		db = lfirst(lc);
		if (db->handle != NULL || !db->wanted ||
			(OidIsValid(db->dboid) && outbox_database_blocked(db->dboid)))
			continue;
		if (db->obstacle != NULL)
		{
			/*
			 * Lists only: show the wait in outbox.status, in a free slot (a
			 * relay that can start takes it back) or else in the list of
			 * databases without a relay; log it once.
			 */
			if (db->slot >= 0 || take_slot(db) >= 0)
			{
				outbox_status_slot(&outbox_shared->slots[db->slot], MyProcPid,
								   OUTBOX_STATE_WAITING_FOR_DATABASE, db->obstacle);
				db->unserved_since = 0;
			}
			else
			{
				if (db->unserved_since == 0)
					db->unserved_since = now;
				unserved[nunserved++] = db;
			}
			if (db->logged_obstacle == NULL || strcmp(db->logged_obstacle, db->obstacle) != 0)
			{
				ereport(LOG,
						(errmsg("outbox relay is waiting: %s", db->obstacle),
						 errdetail("It connects to database \"%s\"%s%s%s.", db->name,
								   outbox_role[0] != '\0' ? " as role \"" : "",
								   outbox_role, outbox_role[0] != '\0' ? "\"" : ""),
						 errhint("Create the database, or the role with LOGIN, or change outbox.databases, outbox.database or outbox.role.")));
				if (db->logged_obstacle)
					pfree(db->logged_obstacle);
				db->logged_obstacle = MemoryContextStrdup(TopMemoryContext, db->obstacle);
			}
			nap = Min(nap, LAUNCHER_BUSY_NAP_MS);
			continue;
		}
		/* a listed database gets a relay that waits for the extension */
		if (db->absent)
		{
			if (all && !TimestampDifferenceExceeds(db->absent_at, now, ABSENT_REPROBE_MS))
				continue;
			db->absent = false;
		}
		if (db->start_after > now)
		{
			nap = Min(nap, Max(TimestampDifferenceMilliseconds(now, db->start_after), 10));
			continue;
		}
		if (!start_relay(db, now))
		{
			if (db->unserved_since == 0)
				db->unserved_since = now;
			unserved[nunserved++] = db;
			nap = Min(nap, LAUNCHER_BUSY_NAP_MS);
		}
	}
	report_unserved(unserved, nunserved);
	return nap;
}

/*
 * Take the CREATE EXTENSION events lifecycle.c left: their databases are
 * probed again at once.
 */
static void
take_events(void)
{
	Oid			events[OUTBOX_MAX_EVENTS];
	bool		overflow;
	int			n = outbox_take_created(events, &overflow);
	HASH_SEQ_STATUS seq;
	LauncherDb *db;
	int			i;

	if (n == 0 && !overflow)
		return;
	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		for (i = 0; i < n && !overflow; i++)
			if (events[i] == db->dboid)
				break;
		if (overflow || i < n)
		{
			/* a relay that looked before the commit must not make it absent */
			db->created = true;
			db->absent = false;
			db->failures = 0;
			db->start_after = 0;
		}
	}
}

/*
 * Forget relays that exited.  One that found no extension ('*') marks its
 * database absent; one we stopped is done; any other exit is a failure
 * (FATAL while connecting, say) and delays the next start.
 */
static void
reap_relays(TimestampTz now)
{
	HASH_SEQ_STATUS seq;
	LauncherDb *db;

	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		pid_t		pid;
		bool		absent;
		bool		connected;
		int			delay;

		if (db->handle == NULL)
			continue;
		switch (GetBackgroundWorkerPid(db->handle, &pid))
		{
			case BGWH_STOPPED:
				break;
			case BGWH_POSTMASTER_DIED:
				proc_exit(1);
				break;
			default:
				continue;
		}
		pfree(db->handle);
		db->handle = NULL;
		SpinLockAcquire(&outbox_shared->slots[db->slot].mutex);
		absent = outbox_shared->slots[db->slot].extension_absent;
		connected = outbox_shared->slots[db->slot].connected;
		SpinLockRelease(&outbox_shared->slots[db->slot].mutex);
		if (db->stopping || absent || connected)
			free_slot(db);
		if (db->stopping)
			db->stopping = false;
		else if (absent && db->created)
			db->start_after = 0;	/* it looked too early: start it again */
		else if (absent)
		{
			db->absent = true;
			db->absent_at = now;
			db->failures = 0;
		}
		else
		{
			if (TimestampDifferenceExceeds(db->started_at, now, RELAY_STABLE_MS))
				db->failures = 0;
			delay = Min(RELAY_BACKOFF_MIN_MS << Min(db->failures, 6), RELAY_BACKOFF_MAX_MS);
			db->failures++;
			db->start_after = TimestampTzPlusMilliseconds(now, delay);
			if (!connected)
				outbox_status_refused(&outbox_shared->slots[db->slot], db->name, delay);
		}
	}
}

/*
 * Read pg_database and mark the covered databases wanted (creating their
 * entries); returns them as a List of LauncherDb in slot priority order.
 */
static List *
plan_databases(bool *all)
{
	List	   *names = outbox_relayed_databases(all);
	List	   *covered = NIL;
	OutboxDatabase *rows;
	int			nrows;
	HASH_SEQ_STATUS seq;
	LauncherDb *db;
	ListCell   *lc;
	int			i;

	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
		db->wanted = false;

	StartTransactionCommand();
	(void) GetTransactionSnapshot();
	/* what we keep must outlive the transaction */
	MemoryContextSwitchTo(pass_context);
	rows = outbox_scan_databases(&nrows);

	if (*all)
	{
		/* heap order is about creation order; OIDs would not be better */
		for (i = 0; i < nrows; i++)
		{
			if (!rows[i].allow_connections || rows[i].is_template)
				continue;
			names = lappend(names, rows[i].name);
		}
	}
	foreach(lc, names)
	{
		const char *name = lfirst(lc);
		const OutboxDatabase *row = NULL;
		bool		found;

		for (i = 0; i < nrows && row == NULL; i++)
			if (strcmp(rows[i].name, name) == 0)
				row = &rows[i];
		db = hash_search(databases, name, HASH_ENTER, &found);
		if (!found)
		{
			memset((char *) db + NAMEDATALEN, 0, sizeof(LauncherDb) - NAMEDATALEN);
			db->slot = -1;
		}
		if (db->wanted)
			continue;			/* named twice */
		db->wanted = true;
		set_target(db, row);
		covered = lappend(covered, db);
	}
	CommitTransactionCommand();
	MemoryContextSwitchTo(pass_context);
	return covered;
}

/*
 * Record what the launcher found for a covered database: its pg_database
 * row (NULL if none) and whether a relay could connect.  A database
 * dropped and created again under the same name is a new one: its old
 * relay is stopped and the delays are forgotten.
 */
static void
set_target(LauncherDb *db, const OutboxDatabase *row)
{
	const char *obstacle;
	Oid			roleoid;

	if (row != NULL && OidIsValid(db->dboid) && db->dboid != row->oid)
	{
		if (db->handle != NULL)
			stop_relay(db);
		db->absent = false;
		db->failures = 0;
		db->start_after = 0;
	}
	if (row != NULL)
		db->dboid = row->oid;
	obstacle = outbox_connection_obstacle(db->name, row, &roleoid);
	db->roleoid = roleoid;
	if (db->obstacle)
		pfree(db->obstacle);
	db->obstacle = obstacle ? MemoryContextStrdup(TopMemoryContext, obstacle) : NULL;
	if (obstacle == NULL && db->logged_obstacle != NULL)
	{
		ereport(LOG,
				(errmsg("outbox relay can connect to database \"%s\" now", db->name)));
		pfree(db->logged_obstacle);
		db->logged_obstacle = NULL;
	}
}

/*
 * Ask a relay to stop (SIGTERM, through the postmaster); reaped once it
 * has exited, without a restart delay.
 */
static void
stop_relay(LauncherDb *db)
{
	if (db->stopping)
		return;
	TerminateBackgroundWorker(db->handle);
	db->stopping = true;
}

/*
 * Start the relay of db in a free slot.  Returns false if it could not
 * start now: no free slot (outbox.max_workers) or no free background
 * worker (max_worker_processes, logged once per episode).
 */
static bool
start_relay(LauncherDb *db, TimestampTz now)
{
	BackgroundWorker worker;
	OutboxRelayArgs args;
	OutboxRelaySlot *slot;
	bool		registered;

	db->no_bgworker = false;
	if (db->slot < 0 && take_slot(db) < 0 &&
		(!free_waiting_slot() || take_slot(db) < 0))
		return false;
	slot = &outbox_shared->slots[db->slot];
	outbox_status_slot(slot, 0, OUTBOX_STATE_STARTING, NULL);
	SpinLockAcquire(&slot->mutex);
	slot->database_oid = db->dboid;
	slot->extension_absent = false;
	slot->connected = false;
	SpinLockRelease(&slot->mutex);

	memset(&args, 0, sizeof(args));
	args.dboid = db->dboid;
	args.roleoid = db->roleoid;
	strlcpy(args.dbname, db->name, NAMEDATALEN);
	StaticAssertStmt(sizeof(OutboxRelayArgs) <= BGW_EXTRALEN,
					 "OutboxRelayArgs does not fit in bgw_extra");

	outbox_init_bgworker(&worker, "outbox_worker_main", "outbox relay",
						 BGW_NEVER_RESTART);
	snprintf(worker.bgw_name, BGW_MAXLEN, "outbox relay for database \"%s\"", db->name);
	worker.bgw_main_arg = Int32GetDatum(db->slot);
	worker.bgw_notify_pid = MyProcPid;
	memcpy(worker.bgw_extra, &args, sizeof(args));

	/* the handle is palloc'd: it must outlive this pass */
	MemoryContextSwitchTo(TopMemoryContext);
	registered = RegisterDynamicBackgroundWorker(&worker, &db->handle);
	MemoryContextSwitchTo(pass_context);
	if (!registered)
	{
		db->handle = NULL;
		db->no_bgworker = true;
		free_slot(db);
		if (!bgw_slots_exhausted)
			ereport(WARNING,
					(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
					 errmsg("outbox launcher cannot start a relay for database \"%s\": no free background worker slot",
							db->name),
					 errhint("Raise max_worker_processes (needs a restart); the launcher retries every second and logs this again only after a relay could start.")));
		bgw_slots_exhausted = true;
		return false;
	}
	bgw_slots_exhausted = false;
	db->unserved_since = 0;
	db->created = false;
	db->started_at = now;
	db->stopping = false;
	return true;
}

/*
 * Hand the databases left without a relay to status.c, which shows them in
 * outbox.cluster_status() and their outbox.status and logs them.
 */
static void
report_unserved(LauncherDb **unserved, int count)
{
	OutboxUnserved *list = palloc0(sizeof(OutboxUnserved) * Max(count, 1));
	int			i;

	for (i = 0; i < count; i++)
	{
		list[i].dboid = unserved[i]->dboid;
		strlcpy(list[i].name, unserved[i]->name, NAMEDATALEN);
		list[i].no_bgworker = unserved[i]->no_bgworker;
		list[i].since = unserved[i]->unserved_since;
		list[i].waiting_for_database = unserved[i]->obstacle != NULL;
		if (unserved[i]->obstacle != NULL)
			strlcpy(list[i].obstacle, unserved[i]->obstacle, sizeof(list[i].obstacle));
	}
	outbox_status_unserved(list, count);
}

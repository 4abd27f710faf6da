/*-------------------------------------------------------------------------
 *
 * launcher.c
 *	  The launcher: a background worker, connected to no database, that
 *	  keeps the relays running of each database that should have them.
 *
 * Registered by _PG_init under shared_preload_libraries.  Like the
 * autovacuum launcher it reads only shared catalogs (pg_database,
 * pg_authid), so it never holds a connection that would block DROP or
 * RENAME of a database.  Each pass it reaps relays that exited (we are
 * their bgw_notify_pid, so the postmaster sets our latch) and delays their
 * restart; reads pg_database and works out the covered databases
 * (outbox.databases, dblist.c); stops relays of databases no longer covered
 * or being dropped or renamed (lifecycle.c); and starts the missing relays
 * as dynamic background workers, each in a slot of shared memory
 * (outbox.max_workers of them; launcher_relays.c runs them).  A database
 * has outbox.workers_per_database relays (partition.c), fewer while the
 * slots or the background workers (max_worker_processes) run short; each
 * covered database gets its first relay before any gets a second, and
 * databases beyond the slots are logged once, by name, and unserved.
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
#include "launcher/launcher.h"
#include "config/dblist.h"
#include "config/guc.h"
#include "config/guc_refusal.h"
#include "launcher/lifecycle.h"
#include "shared/shmem.h"
#include "shared/status.h"
#include "worker/connect.h"

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
/* how long a new launcher waits for the relays of its predecessor to exit */
#define PREDECESSOR_WAIT_MS			10000

static HTAB *databases = NULL;
static MemoryContext pass_context = NULL;

static void launcher_shutdown(int code, Datum arg);
static long launcher_pass(void);
static void take_events(void);
static List *plan_databases(bool *all);
static void set_target(LauncherDb *db, const OutboxDatabase *row);
static bool serve_database(LauncherDb *db, bool all, TimestampTz now,
						   long *nap);
static void start_generation(LauncherDb *db, int want);
static void start_rest(LauncherDb *db, bool all, bool no_worker,
					   TimestampTz now, long *nap);
static void report_short(LauncherDb *db, bool all, TimestampTz now);
static bool wait_for_database(LauncherDb *db, TimestampTz now);
static void report_unserved(LauncherDb **unserved, int count);
static void forget_failures(LauncherDb *db);

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
		if (launcher_relays_running(db) > 0 || inbox_launcher_running(db))
			launcher_stop_relays(db);
		launcher_free_idle_slots(db, 0);
	}
	SpinLockAcquire(&outbox_shared->mutex);
	outbox_shared->launcher_pid = 0;
	outbox_shared->launcher_latch = NULL;
	outbox_shared->nunserved = 0;
	SpinLockRelease(&outbox_shared->mutex);
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
	LauncherDb *first_waits = NULL;

	take_events();
	inbox_launcher_take_requests(databases);
	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
		launcher_reap_relays(db, now);
	covered = plan_databases(&all);

	/* stop what is no longer covered, or is being dropped or renamed */
	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		if (db->wanted && !(OidIsValid(db->dboid) && outbox_database_blocked(db->dboid)))
			continue;
		if (launcher_relays_running(db) > 0 || inbox_launcher_running(db))
			launcher_stop_relays(db);
		else
		{
			launcher_free_idle_slots(db, 0);
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

	/*
	 * Start what is missing, in the order of outbox.databases (or OID), in
	 * two rounds: the first relay of every database, then the others.  The
	 * slots are shared out so (launcher_allot_slots), and the background
	 * workers must be taken so too: max_worker_processes may have fewer
	 * than the slots, and a database's second relay must never take the
	 * worker another database's first one needed.
	 */
	launcher_allot_slots(covered, all, now);
	unserved = palloc(sizeof(LauncherDb *) * Max(list_length(covered), 1));
	foreach(lc, covered)
	{
		db = lfirst(lc);
		db->start_rest = false;
		if (!db->wanted ||
			(OidIsValid(db->dboid) && outbox_database_blocked(db->dboid)))
			continue;
		if (!serve_database(db, all, now, &nap))
		{
			if (db->unserved_since == 0)
				db->unserved_since = now;
			unserved[nunserved++] = db;
			nap = Min(nap, LAUNCHER_BUSY_NAP_MS);
			if (db->no_bgworker && db->obstacle == NULL &&
				first_waits == NULL && launcher_needs_relay(db, all))
				first_waits = db;
		}
	}

	/*
	 * The others; but when a database that needs a relay has none for want
	 * of a background worker, start no second relay anywhere (a generation
	 * short of one runs smaller, see start_rest), and have another database
	 * give one up: a later pass starts the first relay with it.
	 */
	foreach(lc, covered)
		start_rest(lfirst(lc), all, first_waits != NULL, now, &nap);
	if (first_waits != NULL)
		launcher_give_up_relay(first_waits, covered, databases, now);
	report_unserved(unserved, nunserved);
	/* inbox workers after every database's relays (launcher_inbox.c) */
	inbox_launcher_serve_all(covered, nunserved == 0, now, &nap);
	return nap;
}

/*
 * Keep the relays of a covered database running: start a generation of
 * db->allotted relays, each with its slot taken at once, start its first
 * relay (or restart it after its delay), and retire them all when the
 * database should run another number of them.  The generation's other
 * relays start in the pass's second round (start_rest), if db->start_rest.
 * Lowers *nap (ms) to when it wants to look again.  False if the database
 * has no relay for want of a slot or a background worker (or no slot to
 * wait in, see wait_for_database).
 */
static bool
serve_database(LauncherDb *db, bool all, TimestampTz now, long *nap)
{
	int			running = launcher_relays_running(db);
	int			want = Max(db->allotted, 1);
	LauncherRelay *first = &db->relays[0];

	if (running == 0 && db->obstacle != NULL)
	{
		/* it waits in relay 0's slot; the others' are for relays that run */
		launcher_free_idle_slots(db, 1);
		*nap = Min(*nap, LAUNCHER_BUSY_NAP_MS);
		return wait_for_database(db, now);
	}
	if (running == 0 && !launcher_wants_relays(db, all, now))
		return true;
	db->absent = false;

	/* another k: the new relays start once every old one has exited */
	if (running > 0 && want != db->nworkers)
	{
		if (launcher_retire_relays(db, now))
		{
			*nap = Min(*nap, LAUNCHER_BUSY_NAP_MS);
			return true;
		}
		running = 0;
	}
	if (running == 0)
		start_generation(db, want);

	if (first->handle == NULL && first->start_after > now)
		*nap = Min(*nap, Max(TimestampDifferenceMilliseconds(now, first->start_after), 10));
	else if (first->handle == NULL && !launcher_start_relay(db, 0, databases, now))
	{
		/* its slot is being freed: another database's relays retire */
		if (db->allotted > 0 && !db->no_bgworker)
		{
			*nap = Min(*nap, LAUNCHER_BUSY_NAP_MS);
			return true;
		}
		return false;
	}
	db->start_rest = true;
	return true;
}

/*
 * Begin a generation of want relays for db: take a slot for each now (a
 * relay that starts later must find its own).
 */
static void
start_generation(LauncherDb *db, int want)
{
	int			j;

	launcher_free_idle_slots(db, want);
	for (j = 0; j < want; j++)
		if (db->relays[j].slot < 0 && launcher_take_slot(db, j) < 0)
			break;
	db->nworkers = Max(j, 1);
	launcher_free_idle_slots(db, db->nworkers);
	db->new_generation = true;
}

/*
 * The pass's second round: start the relays of db's generation after the
 * first (each once its restart delay passed), lowering *nap (ms) to the
 * next delay.  When max_worker_processes has no background worker for one,
 * or no_worker (a first relay found none), the database runs as many as
 * started, for BGW_CAP_MS: its next generation is that small
 * (launcher_relays_wanted), so that its buckets do not wait for a worker.
 */
static void
start_rest(LauncherDb *db, bool all, bool no_worker, TimestampTz now,
		   long *nap)
{
	int			j;

	if (!db->start_rest)
		return;
	for (j = 1; j < db->nworkers; j++)
	{
		LauncherRelay *r = &db->relays[j];

		if (r->handle != NULL)
			continue;
		if (r->start_after > now)
		{
			*nap = Min(*nap, Max(TimestampDifferenceMilliseconds(now, r->start_after), 10));
			continue;
		}
		if (no_worker || !launcher_start_relay(db, j, databases, now))
		{
			db->bgw_cap = launcher_relays_running(db);
			db->bgw_cap_until = TimestampTzPlusMilliseconds(now, BGW_CAP_MS);
			*nap = Min(*nap, LAUNCHER_BUSY_NAP_MS);
			break;
		}
	}
	report_short(db, all, now);
}

/*
 * Say once when db's generation that began in this pass runs fewer than k
 * relays.  Only once they all run: a generation whose next relay got no
 * background worker is retired, and the smaller one after it says so.
 */
static void
report_short(LauncherDb *db, bool all, TimestampTz now)
{
	int			k = outbox_workers_per_database;

	if (!db->new_generation)
		return;
	db->new_generation = false;
	if (launcher_relays_running(db) < db->nworkers)
		return;
	if (all && !db->confirmed)
		return;					/* one relay to look for the extension */
	if (db->nworkers < k && !db->short_logged)
		ereport(WARNING,
				(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
				 errmsg("outbox launcher runs %d of %d relays for database \"%s\"",
						db->nworkers, k, db->name),
				 db->bgw_cap > 0 && now < db->bgw_cap_until ?
				 errdetail("max_worker_processes has too few background workers (one relay for each covered database first); the launcher tries %d again in %d s.",
						   k, BGW_CAP_MS / 1000) :
				 errdetail("outbox.max_workers = %d slots serve every database, one relay for each covered database first; outbox.workers_per_database = %d.",
						   outbox_max_workers, outbox_workers_per_database),
				 errhint("Raise outbox.max_workers or max_worker_processes (both need a restart), or lower outbox.workers_per_database. The database gets its %d relays once they are free.",
						 k)));
	db->short_logged = db->nworkers < k;
}

/*
 * Lists only: a covered database that cannot be connected to.  Show the
 * wait in outbox.status, in a free slot (a relay that can start takes it
 * back) or else in the list of databases without a relay (then false);
 * log it once.
 */
static bool
wait_for_database(LauncherDb *db, TimestampTz now)
{
	bool		shown = false;

	if (db->relays[0].slot >= 0 || launcher_take_slot(db, 0) >= 0)
	{
		outbox_status_slot(&outbox_shared->slots[db->relays[0].slot], MyProcPid,
						   OUTBOX_STATE_WAITING_FOR_DATABASE, db->obstacle);
		db->unserved_since = 0;
		shown = true;
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
	return shown;
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
			forget_failures(db);
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

	SetCurrentStatementStartTimestamp();
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
			launcher_init_relays(db);
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
		launcher_stop_relays(db);
		db->absent = false;
		forget_failures(db);
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

/* start the relays of db again without delay */
static void
forget_failures(LauncherDb *db)
{
	int			j;

	for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
	{
		db->relays[j].failures = 0;
		db->relays[j].start_after = 0;
	}
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

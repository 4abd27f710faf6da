/*-------------------------------------------------------------------------
 *
 * launcher_relays.c
 *	  The launcher's relays of one database: start them in worker slots,
 *	  reap them, restart one that failed after a delay, and stop them.
 *
 * A database has k relays (outbox.workers_per_database, partition.c), each
 * a dynamic background worker in a slot of shared memory.  launcher.c
 * decides which databases get relays; this file shares the slots out among
 * them (launcher_allot_slots) and runs the relays.  Background workers
 * (max_worker_processes) may run out before the slots do; the launcher
 * cannot count them, it sees only a start that fails.  A database whose
 * second relay finds none runs a smaller generation for BGW_CAP_MS; one
 * whose first relay finds none gets one from another database's extra
 * relays (launcher_give_up_relay).
 * To change k the launcher retires the database's relays (each exits
 * between two batches, so nothing it claimed is left half-sent) and starts
 * the new ones only when all have exited: two relays never serve one
 * bucket at once.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/guc.h"
#include "launcher/launcher.h"
#include "launcher/lifecycle.h"
#include "shared/bgworker.h"
#include "shared/shmem.h"
#include "shared/status.h"
#include "worker/connect.h"

#include "postmaster/bgworker.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* delay before a relay that exited unexpectedly is started again */
#define RELAY_BACKOFF_MIN_MS		1000
#define RELAY_BACKOFF_MAX_MS		60000
/* a relay that ran this long before exiting starts its backoff afresh */
#define RELAY_STABLE_MS				60000
/* a relay asked to retire gets SIGTERM after its batch's longest wait */
#define RETIRE_MARGIN_MS			10000

/*
 * launcher_wants_relays
 *		Does db want relays started now?  Not while it cannot be connected to,
 * nor ('*') while its relay found no extension there lately.
 */
bool
launcher_wants_relays(LauncherDb *db, bool all, TimestampTz now)
{
	if (launcher_relays_running(db) > 0)
		return true;
	if (db->obstacle != NULL)
		return false;
	return !(db->absent && all &&
			 !TimestampDifferenceExceeds(db->absent_at, now, ABSENT_REPROBE_MS));
}

/*
 * launcher_relays_wanted
 *		How many relays db may run: outbox.workers_per_database, 1 under '*'
 * until a relay found the extension there (the others would only start to
 * exit again), and fewer for a while after max_worker_processes had no
 * background worker for the next one.
 */
int
launcher_relays_wanted(LauncherDb *db, bool all, TimestampTz now)
{
	int			k = outbox_workers_per_database;

	if (launcher_relay_found_extension(db))
		db->confirmed = true;
	if (all && !db->confirmed)
		k = 1;
	if (db->bgw_cap > 0 && now < db->bgw_cap_until)
		k = Min(k, db->bgw_cap);
	return k;
}

/*
 * launcher_allot_slots
 *		Share the outbox.max_workers slots among the covered databases (covered,
 * in slot priority order): one relay each first, those that run before the
 * others, then the rest of what each wants, in order.  Deterministic, so
 * that databases never take slots from each other in turn.  Sets
 * db->allotted (0: no slot for it).
 */
void
launcher_allot_slots(List *covered, bool all, TimestampTz now)
{
	int			budget = outbox_shared->nslots;
	List	   *eligible = NIL;
	ListCell   *lc;

	foreach(lc, covered)
	{
		LauncherDb *db = lfirst(lc);

		db->allotted = 0;
		db->inbox.allotted = false;
		if (db->wanted && launcher_wants_relays(db, all, now) &&
			!(OidIsValid(db->dboid) && outbox_database_blocked(db->dboid)))
			eligible = lappend(eligible, db);
	}
	/* one relay each: the databases that run one keep it, then the others */
	foreach(lc, eligible)
	{
		LauncherDb *db = lfirst(lc);

		if (launcher_relays_running(db) > 0 && budget > 0)
		{
			db->allotted = 1;
			budget--;
		}
	}
	foreach(lc, eligible)
	{
		LauncherDb *db = lfirst(lc);

		if (db->allotted == 0 && budget > 0)
		{
			db->allotted = 1;
			budget--;
		}
	}
	/* inbox workers that run or were asked for (launcher_inbox.c) */
	budget -= inbox_launcher_allot(eligible, budget, true, now);
	/* then the rest of each database's k, in order */
	foreach(lc, eligible)
	{
		LauncherDb *db = lfirst(lc);
		int			more;

		if (db->allotted == 0)
			continue;
		more = Min(launcher_relays_wanted(db, all, now) - 1, budget);
		db->allotted += more;
		budget -= more;
	}
	/* last, inbox workers that only look for subscriptions */
	budget -= inbox_launcher_allot(eligible, budget, false, now);
	list_free(eligible);
}

/*
 * launcher_needs_relay
 *		Is db known to need a relay: listed, or ('*') its relay found the
 *		extension there, or CREATE EXTENSION outbox committed there since?
 *		Under '*' a database the launcher has not looked into yet, or found
 *		no extension in, may need none: its relay takes no background
 *		worker from another database's (launcher_give_up_relay).
 */
bool
launcher_needs_relay(const LauncherDb *db, bool all)
{
	return !all || db->confirmed || db->created;
}

/*
 * launcher_give_up_relay
 *		needy, a covered database that needs a relay, got no background
 *		worker for its first one: max_worker_processes is used up.  The last
 *		database in covered (slot priority order) that runs more than one
 *		relay runs one fewer, for BGW_CAP_MS, as if its own next relay had
 *		found no worker (launcher_relays_wanted): its relays retire, and its
 *		smaller generation starts after them in a pass's first round, beside
 *		needy's first relay, which takes the worker it gave up.  Nothing
 *		while relays of any database are exiting (their workers are about to
 *		be free), nor when no database runs more than one relay.
 */
void
launcher_give_up_relay(LauncherDb *needy, List *covered, HTAB *databases,
					   TimestampTz now)
{
	HASH_SEQ_STATUS seq;
	LauncherDb *db;
	LauncherDb *giver = NULL;
	ListCell   *lc;
	int			j;

	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
		{
			if (db->relays[j].handle != NULL && db->relays[j].stopping)
			{
				hash_seq_term(&seq);
				return;
			}
		}
	}
	foreach(lc, covered)
	{
		db = lfirst(lc);
		if (db->wanted && launcher_relays_running(db) > 1)
			giver = db;
	}
	if (giver == NULL)
		return;
	giver->bgw_cap = launcher_relays_running(giver) - 1;
	giver->bgw_cap_until = TimestampTzPlusMilliseconds(now, BGW_CAP_MS);
	ereport(LOG,
			(errmsg("outbox launcher gives a background worker of database \"%s\" to database \"%s\", which has no relay",
					giver->name, needy->name),
			 errdetail("max_worker_processes is used up and every covered database gets one relay before any gets a second: \"%s\" runs %d relays for %d s.",
					   giver->name, giver->bgw_cap, BGW_CAP_MS / 1000)));
}

/* the last start failed for lack of a background worker (logged once) */
static bool bgw_slots_exhausted = false;

static bool free_waiting_slot(HTAB *databases);

/*
 * launcher_init_relays
 *		A new database entry has no relay and holds no slot.
 */
void
launcher_init_relays(LauncherDb *db)
{
	int			j;

	for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
		db->relays[j].slot = -1;
	inbox_launcher_init(db);
}

/*
 * launcher_relays_running
 *		How many relays of db run (or were started and not yet reaped).
 */
int
launcher_relays_running(const LauncherDb *db)
{
	int			n = 0;
	int			j;

	for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
		if (db->relays[j].handle != NULL)
			n++;
	return n;
}

/*
 * launcher_take_slot
 *		Relay worker of db takes a free slot; returns it, or -1 if none is
 *		free.
 */
int
launcher_take_slot(LauncherDb *db, int worker)
{
	return db->relays[worker].slot = outbox_slot_take(db->dboid, db->name);
}

/*
 * launcher_free_slot
 *		Relay worker of db gives its slot back, if it holds one.
 */
void
launcher_free_slot(LauncherDb *db, int worker)
{
	if (db->relays[worker].slot >= 0)
		outbox_slot_free(db->relays[worker].slot);
	db->relays[worker].slot = -1;
}

/*
 * launcher_free_idle_slots
 *		Give back the slots of db's relays from worker on that do not run:
 *		a slot kept to show why a relay could not connect, or the one the
 *		launcher waits in for the database.
 */
void
launcher_free_idle_slots(LauncherDb *db, int worker)
{
	int			j;

	for (j = worker; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
		if (db->relays[j].handle == NULL)
			launcher_free_slot(db, j);
}

/*
 * Free a slot the launcher holds only to show a database it waits for
 * (waiting_for_database): a relay that can run needs it more.  False if
 * there is none.
 */
static bool
free_waiting_slot(HTAB *databases)
{
	HASH_SEQ_STATUS seq;
	LauncherDb *db;

	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		if (db->obstacle != NULL && db->relays[0].slot >= 0 &&
			launcher_relays_running(db) == 0)
		{
			launcher_free_slot(db, 0);
			hash_seq_term(&seq);
			return true;
		}
	}
	return false;
}

/*
 * Forget relay worker of db if it exited.  One that found no extension
 * ('*') marks its database absent; one we stopped is done; any other exit
 * is a failure (FATAL while connecting, say) and delays its next start.
 */
static void
reap_relay(LauncherDb *db, int worker, TimestampTz now)
{
	LauncherRelay *r = &db->relays[worker];
	OutboxRelaySlot *slot = &outbox_shared->slots[r->slot];
	pid_t		pid;
	bool		absent;
	bool		connected;
	bool		retired;
	int			delay;

	switch (GetBackgroundWorkerPid(r->handle, &pid))
	{
		case BGWH_STOPPED:
			break;
		case BGWH_POSTMASTER_DIED:
			proc_exit(1);
			break;
		default:
			return;
	}
	pfree(r->handle);
	r->handle = NULL;
	SpinLockAcquire(&slot->mutex);
	absent = slot->extension_absent;
	connected = slot->connected;
	retired = slot->retire;		/* asked to, or on its own (worker.c) */
	SpinLockRelease(&slot->mutex);
	/* a relay that failed keeps its slot for its restart */
	if (r->stopping || retired || absent)
		launcher_free_slot(db, worker);
	if (r->stopping || retired)
		r->stopping = r->retiring = false;
	else if (absent && db->created)
		r->start_after = 0;		/* it looked too early: start it again */
	else if (absent)
	{
		db->absent = true;
		db->confirmed = false;
		db->absent_at = now;
		r->failures = 0;
	}
	else
	{
		if (TimestampDifferenceExceeds(r->started_at, now, RELAY_STABLE_MS))
			r->failures = 0;
		delay = Min(RELAY_BACKOFF_MIN_MS << Min(r->failures, 6), RELAY_BACKOFF_MAX_MS);
		r->failures++;
		r->start_after = TimestampTzPlusMilliseconds(now, delay);
		if (!connected)
			outbox_status_refused(slot, db->name, delay);
	}
}

/*
 * launcher_reap_relays
 *		Reap the relays of db that exited (we are their bgw_notify_pid: the
 *		postmaster sets our latch when one does).
 */
void
launcher_reap_relays(LauncherDb *db, TimestampTz now)
{
	int			j;

	for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
		if (db->relays[j].handle != NULL)
			reap_relay(db, j, now);
	inbox_launcher_reap(db, now);
}

/*
 * launcher_stop_relays
 *		Ask every relay of db to stop now (SIGTERM, through the postmaster;
 *		a batch is cut short and what Kafka acknowledged is marked): its
 *		database is dropped, renamed or no longer covered.  Reaped once they
 *		have exited, without a restart delay.
 */
void
launcher_stop_relays(LauncherDb *db)
{
	int			j;

	for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
	{
		LauncherRelay *r = &db->relays[j];

		if (r->handle == NULL || (r->stopping && !r->retiring))
			continue;
		TerminateBackgroundWorker(r->handle);
		r->stopping = true;
		r->retiring = false;
	}
	inbox_launcher_stop(db);
}

/*
 * launcher_retire_relays
 *		Ask every relay of db to exit between two batches (k changes), and
 *		send SIGTERM to one that has not after the longest a batch waits
 *		for Kafka.  True while some still run.
 */
bool
launcher_retire_relays(LauncherDb *db, TimestampTz now)
{
	bool		running = false;
	int			j;

	for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
	{
		LauncherRelay *r = &db->relays[j];
		OutboxRelaySlot *slot;
		Latch	   *latch;

		if (r->handle == NULL)
			continue;
		running = true;
		if (r->stopping)
		{
			if (r->retiring &&
				TimestampDifferenceExceeds(r->stop_asked_at, now,
										   outbox_delivery_timeout + RETIRE_MARGIN_MS))
			{
				TerminateBackgroundWorker(r->handle);
				r->retiring = false;
			}
			continue;
		}
		slot = &outbox_shared->slots[r->slot];
		SpinLockAcquire(&slot->mutex);
		slot->retire = true;
		latch = slot->worker_latch;
		SpinLockRelease(&slot->mutex);
		if (latch != NULL)
			SetLatch(latch);
		r->stopping = r->retiring = true;
		r->stop_asked_at = now;
	}
	return running;
}

/*
 * launcher_relay_found_extension
 *		Has relay 0 of db found the extension (or does it wait for it, a
 *		listed database)?  Under '*' a database gets its k relays only
 *		then: '*' covers databases without it, where each would start and
 *		exit again.
 */
bool
launcher_relay_found_extension(const LauncherDb *db)
{
	const LauncherRelay *r = &db->relays[0];
	OutboxRelaySlot *slot;
	bool		found;

	if (r->handle == NULL || r->slot < 0)
		return false;
	slot = &outbox_shared->slots[r->slot];
	SpinLockAcquire(&slot->mutex);
	found = slot->has_extension;
	SpinLockRelease(&slot->mutex);
	return found;
}

/*
 * launcher_start_relay
 *		Start relay worker (j of db->nworkers) of db in a free slot, taking
 *		one a database waiting to be connected holds (in databases) if none
 *		is free.  Returns false if it could not start now: no free slot
 *		(outbox.max_workers) or no free background worker
 *		(max_worker_processes, logged once per episode).
 */
bool
launcher_start_relay(LauncherDb *db, int worker, HTAB *databases,
					 TimestampTz now)
{
	LauncherRelay *r = &db->relays[worker];
	BackgroundWorker bgw;
	OutboxRelayArgs args;
	OutboxRelaySlot *slot;
	bool		registered;

	db->no_bgworker = false;
	if (r->slot < 0 && launcher_take_slot(db, worker) < 0 &&
		(!free_waiting_slot(databases) || launcher_take_slot(db, worker) < 0))
		return false;
	slot = &outbox_shared->slots[r->slot];
	outbox_status_slot(slot, 0, OUTBOX_STATE_STARTING, NULL);
	SpinLockAcquire(&slot->mutex);
	slot->database_oid = db->dboid;
	slot->extension_absent = false;
	slot->connected = false;
	slot->has_extension = false;
	slot->retire = false;
	slot->worker = worker;
	slot->nworkers = db->nworkers;
	SpinLockRelease(&slot->mutex);

	memset(&args, 0, sizeof(args));
	args.dboid = db->dboid;
	args.roleoid = db->roleoid;
	args.worker = worker;
	args.nworkers = db->nworkers;
	strlcpy(args.dbname, db->name, NAMEDATALEN);
	StaticAssertStmt(sizeof(OutboxRelayArgs) <= BGW_EXTRALEN,
					 "OutboxRelayArgs does not fit in bgw_extra");

	outbox_init_bgworker(&bgw, "outbox_worker_main", "outbox relay",
						 BGW_NEVER_RESTART);
	if (db->nworkers > 1)
		snprintf(bgw.bgw_name, BGW_MAXLEN, "outbox relay %d/%d for database \"%s\"",
				 worker + 1, db->nworkers, db->name);
	else
		snprintf(bgw.bgw_name, BGW_MAXLEN, "outbox relay for database \"%s\"", db->name);
	bgw.bgw_main_arg = Int32GetDatum(r->slot);
	bgw.bgw_notify_pid = MyProcPid;
	memcpy(bgw.bgw_extra, &args, sizeof(args));

	/* the handle is palloc'd: it must outlive the launcher's pass */
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		registered = RegisterDynamicBackgroundWorker(&bgw, &r->handle);
		MemoryContextSwitchTo(old);
	}
	if (!registered)
	{
		r->handle = NULL;
		db->no_bgworker = true;
		launcher_free_slot(db, worker);
		if (!bgw_slots_exhausted && worker == 0)
			ereport(WARNING,
					(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
					 errmsg("outbox launcher cannot start a relay for database \"%s\": no free background worker slot",
							db->name),
					 errhint("Raise max_worker_processes (needs a restart); the launcher retries every second and logs this again only after a relay could start.")));
		else if (!bgw_slots_exhausted)
			ereport(WARNING,
					(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
					 errmsg("outbox launcher cannot start relay %d of %d for database \"%s\": no free background worker slot",
							worker + 1, db->nworkers, db->name),
					 errhint("Raise max_worker_processes (needs a restart). The database runs the relays that started, for %d s, then tries again.",
							 BGW_CAP_MS / 1000)));
		bgw_slots_exhausted = true;
		return false;
	}
	bgw_slots_exhausted = false;
	db->unserved_since = 0;
	db->created = false;
	r->started_at = now;
	r->stopping = r->retiring = false;
	return true;
}

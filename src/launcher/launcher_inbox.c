/*-------------------------------------------------------------------------
 *
 * launcher_inbox.c
 *	  The launcher's inbox workers: one per covered database that has
 *	  subscriptions, in the outbox.max_workers slots the relays use.
 *
 * The launcher reads only shared catalogs, so it cannot see whether a
 * database has subscriptions.  It starts an inbox worker in each database
 * its relays cover; a worker that finds no subscription exits with code 0
 * and says so in shared memory (inbox_shmem.c), and the launcher starts
 * none there again until outbox.subscribe() or resume_subscription()
 * commits in it (a request in shared memory, taken each pass) or
 * INBOX_REPROBE_MS passed.
 *
 * Slots: in each share (launcher_allot_slots) a database's inbox worker
 * that runs, or was asked for by a subscription, comes right after the
 * first relay of every database; a worker that only looks for
 * subscriptions comes last, after every relay a database wants, so that it
 * never keeps a relay from its slot.  Background workers (max_worker_processes)
 * are not shared out: so an inbox worker starts only once its database's
 * relays all run, and one that only looks only once every covered
 * database's relays run, never while a generation of relays starts or
 * retires (it would take the background worker a relay needs, and the
 * database would run fewer relays for a while).  A worker that failed is
 * started again after a delay that doubles up to a minute, like a relay.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "launcher/launcher_inbox.h"
#include "launcher/launcher.h"
#include "launcher/lifecycle.h"
#include "shared/bgworker.h"
#include "shared/inbox_shmem.h"
#include "shared/shmem.h"

#include "postmaster/bgworker.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* a database without subscriptions is looked at again after this long */
#define INBOX_REPROBE_MS		(5 * 60 * 1000)
/* delay before an inbox worker that failed is started again */
#define INBOX_BACKOFF_MIN_MS	1000
#define INBOX_BACKOFF_MAX_MS	60000
/* a worker that ran this long before failing starts its backoff afresh */
#define INBOX_STABLE_MS			60000

/*
 * inbox_launcher_init
 *		A new database entry has no inbox worker and holds no slot for one.
 */
void
inbox_launcher_init(LauncherDb *db)
{
	memset(&db->inbox, 0, sizeof(db->inbox));
	db->inbox.slot = -1;
}

/*
 * inbox_launcher_running
 *		Does db's inbox worker run (or was it started and not yet reaped)?
 */
bool
inbox_launcher_running(const LauncherDb *db)
{
	return db->inbox.handle != NULL;
}

/* does db want an inbox worker started (or kept) now? */
static bool
wants_inbox(LauncherDb *db, TimestampTz now)
{
	LauncherInbox *in = &db->inbox;

	if (in->handle != NULL || in->requested)
		return true;
	return !(in->idle && !TimestampDifferenceExceeds(in->idle_at, now, INBOX_REPROBE_MS));
}

/*
 * inbox_launcher_allot
 *		Give inbox workers of the databases in eligible (the databases that
 *		get relays, in slot priority order) slots out of budget; returns how
 *		many it gave.  first: the pass right after each database's first
 *		relay, for workers that run or were asked for; otherwise the last
 *		pass, for the others.
 */
int
inbox_launcher_allot(List *eligible, int budget, bool first, TimestampTz now)
{
	int			given = 0;
	ListCell   *lc;

	foreach(lc, eligible)
	{
		LauncherDb *db = lfirst(lc);
		LauncherInbox *in = &db->inbox;

		if (first)
			in->allotted = false;
		if (in->allotted || given >= budget || !wants_inbox(db, now))
			continue;
		if (first && in->handle == NULL && !in->requested)
			continue;
		in->allotted = true;
		given++;
	}
	return given;
}

/*
 * Do all of db's relays run, none stopping or retiring?  A database the
 * last share gave no relay (none wanted, or no slot) has none to wait for.
 */
static bool
relays_settled(const LauncherDb *db)
{
	int			j;

	if (db->allotted == 0 || db->obstacle != NULL)
		return true;
	if (launcher_relays_running(db) < db->allotted)
		return false;
	for (j = 0; j < OUTBOX_MAX_WORKERS_PER_DATABASE; j++)
		if (db->relays[j].handle != NULL && db->relays[j].stopping)
			return false;
	return true;
}

/*
 * inbox_launcher_serve_all
 *		After the relays of this pass: start the inbox workers of the
 *		databases in covered (wanted ones; a blocked database is skipped)
 *		whose relays all run; one that only looks for subscriptions only when
 *		every database is served (served) and settled.  Lowers *nap (ms).
 */
void
inbox_launcher_serve_all(List *covered, bool served, TimestampTz now, long *nap)
{
	bool		settled = served;
	ListCell   *lc;

	foreach(lc, covered)
	{
		LauncherDb *db = lfirst(lc);

		if (db->wanted && !relays_settled(db))
			settled = false;
	}
	foreach(lc, covered)
	{
		LauncherDb *db = lfirst(lc);
		LauncherInbox *in = &db->inbox;

		if (!db->wanted || (OidIsValid(db->dboid) && outbox_database_blocked(db->dboid)))
			continue;
		if (!relays_settled(db) ||
			(!settled && in->handle == NULL && !in->requested))
		{
			if (in->allotted && in->handle == NULL)
				*nap = Min(*nap, 1000);
			continue;
		}
		inbox_launcher_serve(db, now, nap);
	}
}

/*
 * inbox_launcher_serve
 *		Start db's inbox worker if it has a slot in this share, none runs and
 *		its restart delay has passed; lowers *nap (ms) to when it wants to
 *		look again.
 */
void
inbox_launcher_serve(LauncherDb *db, TimestampTz now, long *nap)
{
	LauncherInbox *in = &db->inbox;
	BackgroundWorker bgw;
	InboxArgs	args;
	OutboxRelaySlot *slot;
	bool		registered;

	if (in->handle != NULL || !in->allotted || db->obstacle != NULL ||
		!OidIsValid(db->dboid))
		return;
	if (in->start_after > now)
	{
		*nap = Min(*nap, Max(TimestampDifferenceMilliseconds(now, in->start_after), 10));
		return;
	}
	if (in->slot < 0)
		in->slot = outbox_slot_take(db->dboid, db->name);
	if (in->slot < 0)
	{
		*nap = Min(*nap, 1000);
		return;
	}
	slot = &outbox_shared->slots[in->slot];
	SpinLockAcquire(&slot->mutex);
	slot->inbox = true;
	slot->database_oid = db->dboid;
	slot->worker_pid = 0;
	slot->worker_latch = NULL;
	SpinLockRelease(&slot->mutex);
	(void) inbox_shmem_slot_idle(in->slot);

	memset(&args, 0, sizeof(args));
	args.dboid = db->dboid;
	strlcpy(args.dbname, db->name, NAMEDATALEN);
	outbox_init_bgworker(&bgw, "outbox_inbox_main", "outbox inbox launcher", BGW_NEVER_RESTART);
	snprintf(bgw.bgw_name, BGW_MAXLEN, "outbox inbox launcher for database \"%s\"", db->name);
	bgw.bgw_main_arg = Int32GetDatum(in->slot);
	bgw.bgw_notify_pid = MyProcPid;
	StaticAssertStmt(sizeof(InboxArgs) <= BGW_EXTRALEN, "InboxArgs does not fit in bgw_extra");
	memcpy(bgw.bgw_extra, &args, sizeof(args));
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		registered = RegisterDynamicBackgroundWorker(&bgw, &in->handle);
		MemoryContextSwitchTo(old);
	}
	if (!registered)
	{
		in->handle = NULL;
		outbox_slot_free(in->slot);
		in->slot = -1;
		*nap = Min(*nap, 1000);
		return;
	}
	in->started_at = now;
	in->stopping = false;
	in->requested = false;
}

/*
 * inbox_launcher_reap
 *		Forget db's inbox worker if it exited: one that found no
 *		subscription makes the database idle for a while; one we stopped is
 *		done; any other exit delays its next start.
 */
void
inbox_launcher_reap(LauncherDb *db, TimestampTz now)
{
	LauncherInbox *in = &db->inbox;
	pid_t		pid;
	int			delay;

	if (in->handle == NULL)
		return;
	switch (GetBackgroundWorkerPid(in->handle, &pid))
	{
		case BGWH_STOPPED:
			break;
		case BGWH_POSTMASTER_DIED:
			proc_exit(1);
			break;
		default:
			return;
	}
	pfree(in->handle);
	in->handle = NULL;
	if (in->slot >= 0)
	{
		if (inbox_shmem_slot_idle(in->slot) && !in->requested)
		{
			in->idle = true;
			in->idle_at = now;
			in->failures = 0;
		}
		else if (!in->stopping && !in->requested)
		{
			if (TimestampDifferenceExceeds(in->started_at, now, INBOX_STABLE_MS))
				in->failures = 0;
			delay = Min(INBOX_BACKOFF_MIN_MS << Min(in->failures, 6), INBOX_BACKOFF_MAX_MS);
			in->failures++;
			in->start_after = TimestampTzPlusMilliseconds(now, delay);
		}
		outbox_slot_free(in->slot);
		in->slot = -1;
	}
	in->stopping = false;
}

/*
 * inbox_launcher_stop
 *		Ask db's inbox worker to exit now (SIGTERM through the postmaster):
 *		its database is dropped, renamed or no longer covered.  What it
 *		applied is committed; a batch in flight rolls back and is applied
 *		again by the next worker.
 */
void
inbox_launcher_stop(LauncherDb *db)
{
	LauncherInbox *in = &db->inbox;

	if (in->handle == NULL || in->stopping)
		return;
	TerminateBackgroundWorker(in->handle);
	in->stopping = true;
}

/*
 * inbox_launcher_take_requests
 *		Take the databases where a subscription committed while no inbox
 *		worker ran: they get one at once, whatever their idle mark says.
 */
void
inbox_launcher_take_requests(HTAB *databases)
{
	Oid			dboids[32];
	bool		overflow;
	int			n = inbox_take_requests(dboids, lengthof(dboids), &overflow);
	HASH_SEQ_STATUS seq;
	LauncherDb *db;
	int			i;

	if (n == 0 && !overflow)
		return;
	hash_seq_init(&seq, databases);
	while ((db = hash_seq_search(&seq)) != NULL)
	{
		for (i = 0; i < n && !overflow; i++)
			if (dboids[i] == db->dboid)
				break;
		if (overflow || i < n)
		{
			db->inbox.requested = true;
			db->inbox.idle = false;
			db->inbox.failures = 0;
			db->inbox.start_after = 0;
		}
	}
}

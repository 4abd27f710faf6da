/*-------------------------------------------------------------------------
 *
 * shmem.c
 *	  Shared-memory state of the relay worker.
 *
 * One small struct, protected by a spinlock, holds what the worker wants
 * others to see (state, counters, last error, written by status.c) and what
 * others need to reach the worker (its latch, so a committing transaction
 * can wake it).  The worker only ever holds the spinlock for a few
 * instructions, so reading the status from SQL can never block the relay.
 *
 * It exists only when the library is in shared_preload_libraries; without it
 * outbox_shared stays NULL and every function here is a no-op, and
 * outbox_relay_coverage says that no relay runs.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/shmem.h"
#include "config/dblist.h"
#include "config/guc.h"
#include "shared/partition.h"
#include "shared/inbox_shmem.h"

#include <signal.h>

#include "access/htup_details.h"
#include "catalog/pg_database.h"
#include "commands/dbcommands.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

OutboxShared *outbox_shared = NULL;
OutboxRelaySlot *outbox_my_slot = NULL;

/* the hooks installed before ours (set by _PG_init) */
shmem_request_hook_type outbox_prev_shmem_request_hook = NULL;
shmem_startup_hook_type outbox_prev_shmem_startup_hook = NULL;

static void outbox_shared_unregister_worker(int code, Datum arg);

/*
 * Size of the struct with outbox.max_workers slots.
 */
static Size
shared_size(void)
{
	return add_size(offsetof(OutboxShared, slots),
					mul_size(sizeof(OutboxRelaySlot), outbox_max_workers));
}

/*
 * outbox_shmem_request
 *		The shmem_request_hook: ask for our shared memory.  Installed by
 *		_PG_init in the postmaster (shared_preload_libraries) only.
 */
void
outbox_shmem_request(void)
{
	if (outbox_prev_shmem_request_hook)
		outbox_prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(shared_size()));
	RequestAddinShmemSpace(MAXALIGN(outbox_inbox_shmem_size()));
}

/*
 * outbox_shmem_startup
 *		The shmem_startup_hook: create or attach to the struct.
 *
 * This also runs after a crash restart, when shared memory is re-created:
 * then every field starts from zero again, so no pid or latch of a dead
 * process survives (see pg_net #211, #276).
 */
void
outbox_shmem_startup(void)
{
	bool		found;
	int			i;

	if (outbox_prev_shmem_startup_hook)
		outbox_prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	outbox_shared = ShmemInitStruct("outbox relay", shared_size(), &found);
	if (!found)
	{
		memset(outbox_shared, 0, shared_size());
		SpinLockInit(&outbox_shared->mutex);
		outbox_shared->nslots = outbox_max_workers;
		for (i = 0; i < outbox_max_workers; i++)
			SpinLockInit(&outbox_shared->slots[i].mutex);
	}
	outbox_inbox_shmem_init();
	LWLockRelease(AddinShmemInitLock);
}

/*
 * outbox_shared_register_worker
 *		Publish the calling relay worker (pid, latch, its index worker of
 *		nworkers relays of its database) in slot number slot (0 ..
 *		outbox.max_workers - 1, given by the launcher) and reset its
 *		counters.  Cleared again when the worker exits.
 */
void
outbox_shared_register_worker(int slot, int worker, int nworkers)
{
	OutboxRelaySlot *s;

	if (outbox_shared == NULL)
		return;
	if (slot < 0 || slot >= outbox_shared->nslots)
		elog(FATAL, "outbox relay started with slot %d of %d", slot,
			 outbox_shared->nslots);
	s = &outbox_shared->slots[slot];
	outbox_my_slot = s;

	SpinLockAcquire(&s->mutex);
	s->worker_pid = MyProcPid;
	s->worker_latch = MyLatch;
	s->database_oid = MyDatabaseId;
	strlcpy(s->database_name, outbox_relay_database, NAMEDATALEN);
	s->started_at = GetCurrentTimestamp();
	s->extension_absent = false;
	s->connected = true;
	s->worker = worker;
	s->nworkers = nworkers;
	s->state = OUTBOX_STATE_STARTING;
	s->published = 0;
	s->failed = 0;
	s->delivery_errors = 0;
	s->last_publish_at = 0;
	s->last_error_at = 0;
	s->last_error[0] = '\0';
	SpinLockRelease(&s->mutex);

	before_shmem_exit(outbox_shared_unregister_worker, (Datum) 0);
}

/*
 * outbox_shared_note_extension
 *		Tell the launcher that the calling relay stays, called once at its
 *		start: it found the extension, or waits for it (a listed database).
 *		Under '*' the launcher gives a database its k relays only then, not
 *		k of them in every database that lacks the extension.
 */
void
outbox_shared_note_extension(void)
{
	if (outbox_my_slot == NULL)
		return;
	SpinLockAcquire(&outbox_my_slot->mutex);
	outbox_my_slot->has_extension = true;
	SpinLockRelease(&outbox_my_slot->mutex);
	outbox_wake_launcher();
}

/*
 * outbox_shared_retiring
 *		Has the launcher asked the calling relay to exit (a new number of
 *		relays for its database)?  The relay then exits between batches.
 */
bool
outbox_shared_retiring(void)
{
	bool		retire;

	if (outbox_my_slot == NULL)
		return false;
	SpinLockAcquire(&outbox_my_slot->mutex);
	retire = outbox_my_slot->retire;
	SpinLockRelease(&outbox_my_slot->mutex);
	return retire;
}

/*
 * Is another relay of this database running whose buckets may overlap ours:
 * one of another generation (another k) or with our own index?
 */
static bool
overlapping_relay_runs(void)
{
	int			i;

	for (i = 0; i < outbox_shared->nslots; i++)
	{
		OutboxRelaySlot *s = &outbox_shared->slots[i];
		bool		overlaps;

		if (s == outbox_my_slot)
			continue;
		SpinLockAcquire(&s->mutex);
		overlaps = !s->inbox && s->worker_latch != NULL && s->worker_pid != MyProcPid &&
			s->database_oid == MyDatabaseId &&
			(s->nworkers != outbox_relay_nworkers || s->worker == outbox_relay_worker);
		SpinLockRelease(&s->mutex);
		if (overlaps)
			return true;
	}
	return false;
}

/*
 * outbox_shared_wait_for_others
 *		Wait (checking every 100 ms; SIGTERM ends it) until no other relay of
 *		this database runs that could serve one of our buckets.  The launcher
 *		starts a new generation only after the old one exited; this keeps
 *		two relays from ever sending one aggregate's events at once, should
 *		a relay outlive its launcher.
 */
void
outbox_shared_wait_for_others(void)
{
	bool		logged = false;

	if (outbox_shared == NULL)
		return;
	while (overlapping_relay_runs() && !outbox_shared_retiring())
	{
		if (!logged)
			ereport(LOG,
					(errmsg("outbox relay %d of %d for database \"%s\" waits for an earlier relay of that database to exit",
							outbox_relay_worker + 1, outbox_relay_nworkers,
							outbox_relay_database)));
		logged = true;
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 100L, outbox_wait_event(OUTBOX_WAIT_DATABASE));
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
}

static void
outbox_shared_unregister_worker(int code, Datum arg)
{
	OutboxRelaySlot *s = outbox_my_slot;

	SpinLockAcquire(&s->mutex);
	if (s->worker_pid == MyProcPid)
	{
		s->worker_pid = 0;
		s->worker_latch = NULL;
	}
	SpinLockRelease(&s->mutex);
}

/*
 * outbox_wake_worker
 *		Set the latch of the relay serving the current database.
 *
 * control: the commit changed how the relay must run (pause(), resume(),
 * replay(), retry_failed()); a paused relay wakes up only for these, not for
 * every commit that emitted.
 *
 * Called at commit of a transaction that emitted.  A stale latch pointer
 * (worker just exited) is harmless: latches live in the PGPROC array, so the
 * worst case is one spurious wake-up of whichever process reuses the slot.
 */
void
outbox_wake_worker(bool control)
{
	int			i;

	if (outbox_shared == NULL)
		return;
	for (i = 0; i < outbox_shared->nslots; i++)
	{
		OutboxRelaySlot *s = &outbox_shared->slots[i];
		Latch	   *latch = NULL;

		/* unlocked peek: a slot of another database is not ours to lock */
		if (s->database_oid != MyDatabaseId || s->inbox)
			continue;
		SpinLockAcquire(&s->mutex);
		if (s->database_oid == MyDatabaseId)
		{
			if (control)
				s->control_seq++;
			/* a paused relay has no use for a wake-up per commit (worker.c) */
			if (s->worker_pid != 0 && s->worker_latch != NULL &&
				(control || s->state != OUTBOX_STATE_PAUSED))
				latch = s->worker_latch;
		}
		SpinLockRelease(&s->mutex);
		if (latch != NULL)
			SetLatch(latch);
	}
}

/*
 * outbox_control_seq
 *		How many control commits (see outbox_wake_worker) the calling
 *		relay's slot has seen.
 */
uint32
outbox_control_seq(void)
{
	uint32		seq;

	if (outbox_my_slot == NULL)
		return 0;
	SpinLockAcquire(&outbox_my_slot->mutex);
	seq = outbox_my_slot->control_seq;
	SpinLockRelease(&outbox_my_slot->mutex);
	return seq;
}

/*
 * outbox_wake_launcher
 *		Set the launcher's latch, if it runs: it then re-reads pg_database,
 *		the events of lifecycle.c and its settings within a second.
 */
void
outbox_wake_launcher(void)
{
	Latch	   *latch;

	if (outbox_shared == NULL)
		return;
	SpinLockAcquire(&outbox_shared->mutex);
	latch = outbox_shared->launcher_pid != 0 ? outbox_shared->launcher_latch : NULL;
	SpinLockRelease(&outbox_shared->mutex);
	if (latch != NULL)
		SetLatch(latch);
}

/*
 * outbox_stop_relays
 *		Send SIGTERM to the running relays of database dboid (InvalidOid:
 *		every relay), and to their VACUUM workers, and wait up to wait_ms
 *		(milliseconds), checking every 10 ms, until none is left.  A VACUUM
 *		worker holds a connection to the database too: DROP DATABASE,
 *		RENAME and TEMPLATE would wait for it and fail.  A relay is a slot with a latch; a slot a
 *		launcher held has none.  Processes interrupts while it waits;
 *		raises no error of its own.
 */
void
outbox_stop_relays(Oid dboid, int wait_ms)
{
	int			waited;
	int			i;

	for (waited = 0;; waited += 10)
	{
		bool		busy = false;

		for (i = 0; i < outbox_shared->nslots; i++)
		{
			OutboxRelaySlot *s = &outbox_shared->slots[i];
			pid_t		pid = 0;

			pid_t		vacuum_pid = 0;

			SpinLockAcquire(&s->mutex);
			if (s->worker_latch != NULL &&
				(!OidIsValid(dboid) || (s->in_use && s->database_oid == dboid)))
				pid = s->worker_pid;
			if (!OidIsValid(dboid) || (s->in_use && s->database_oid == dboid))
				vacuum_pid = s->vacuum_pid;
			SpinLockRelease(&s->mutex);
			if (pid != 0)
			{
				busy = true;
				if (waited == 0)
					(void) kill(pid, SIGTERM);
			}
			/* each pass: it may have registered since the last one */
			if (vacuum_pid != 0)
			{
				busy = true;
				(void) kill(vacuum_pid, SIGTERM);
			}
		}
		if (!busy || waited >= wait_ms)
			break;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(10000L);
	}
}

/*
 * outbox_shared_register_launcher
 *		Publish the calling launcher's pid and latch, then stop the relays a
 *		previous launcher left running (it ended with an ERROR: their
 *		handles died with it), waiting up to wait_ms (milliseconds) for
 *		them to exit, and free every slot.  After a crash restart shared
 *		memory is new and there is nothing to stop.
 */
void
outbox_shared_register_launcher(int wait_ms)
{
	int			i;

	SpinLockAcquire(&outbox_shared->mutex);
	outbox_shared->launcher_pid = MyProcPid;
	outbox_shared->launcher_latch = MyLatch;
	outbox_shared->launcher_started_at = GetCurrentTimestamp();
	outbox_shared->nunserved = 0;
	SpinLockRelease(&outbox_shared->mutex);

	outbox_stop_relays(InvalidOid, wait_ms);
	for (i = 0; i < outbox_shared->nslots; i++)
	{
		OutboxRelaySlot *s = &outbox_shared->slots[i];

		SpinLockAcquire(&s->mutex);
		s->in_use = false;
		s->database_oid = InvalidOid;
		if (s->worker_latch == NULL)
			s->worker_pid = 0;
		SpinLockRelease(&s->mutex);
	}
}

/*
 * outbox_slot_take
 *		Assign a free relay slot to database dboid (InvalidOid while it does
 *		not exist) called name.  Returns the slot's index, or -1 if all
 *		outbox.max_workers slots are in use.  Launcher only.
 */
int
outbox_slot_take(Oid dboid, const char *name)
{
	int			i;

	for (i = 0; i < outbox_shared->nslots; i++)
	{
		OutboxRelaySlot *s = &outbox_shared->slots[i];
		bool		taken = false;

		SpinLockAcquire(&s->mutex);
		if (!s->in_use && s->worker_pid == 0)
		{
			s->in_use = true;
			s->inbox = false;
			s->database_oid = dboid;
			s->worker = s->nworkers = 0;
			strlcpy(s->database_name, name, NAMEDATALEN);
			taken = true;
		}
		SpinLockRelease(&s->mutex);
		if (taken)
			return i;
	}
	return -1;
}

/*
 * outbox_slot_free
 *		Give slot back: its relay has exited, or the launcher held it
 *		itself (then its pid is cleared too).  Launcher only.
 */
void
outbox_slot_free(int slot)
{
	OutboxRelaySlot *s = &outbox_shared->slots[slot];

	SpinLockAcquire(&s->mutex);
	s->in_use = false;
	s->database_oid = InvalidOid;
	if (s->worker_pid == MyProcPid)
		s->worker_pid = 0;
	SpinLockRelease(&s->mutex);
}

/*
 * outbox_take_created
 *		The databases where CREATE EXTENSION outbox committed since the last
 *		call (lifecycle.c records them), up to OUTBOX_MAX_EVENTS OIDs into
 *		dboids; returns how many.  *overflow is set when more did: then any
 *		database may be one.  Launcher only.
 */
int
outbox_take_created(Oid *dboids, bool *overflow)
{
	int			n;

	SpinLockAcquire(&outbox_shared->mutex);
	n = outbox_shared->nevents;
	memcpy(dboids, outbox_shared->events, sizeof(Oid) * n);
	*overflow = outbox_shared->events_overflow;
	outbox_shared->nevents = 0;
	outbox_shared->events_overflow = false;
	SpinLockRelease(&outbox_shared->mutex);
	return n;
}

/*
 * outbox_set_unserved
 *		Publish the covered databases the launcher's last pass could not
 *		start a relay for: n entries of list, of which the first
 *		OUTBOX_MAX_UNSERVED are kept.  Launcher only.
 */
void
outbox_set_unserved(const OutboxUnserved *list, int n)
{
	n = Min(n, OUTBOX_MAX_UNSERVED);
	SpinLockAcquire(&outbox_shared->mutex);
	memcpy(outbox_shared->unserved, list, sizeof(OutboxUnserved) * n);
	outbox_shared->nunserved = n;
	SpinLockRelease(&outbox_shared->mutex);
}

/* names of the OutboxWait values, in their order */
static const char *const wait_event_names[OUTBOX_WAIT_COUNT] = {
	"OutboxIdle",
	"OutboxWaitForDatabase",
	"OutboxPaused",
	"OutboxErrorBackoff",
	"OutboxProducerQueueFull",
	"OutboxDeliveryReports",
};

/*
 * outbox_relay_coverage
 *		Does a relay publish this database's outbox?  OUTBOX_NOT_PRELOADED: no
 *		relay runs at all (the library is not in shared_preload_libraries);
 *		OUTBOX_OTHER_DATABASE: this database is not covered by
 *		outbox.databases (or outbox.database when that is empty);
 *		OUTBOX_UNSERVABLE_DATABASE: it is, but it is a template or does not
 *		accept connections, so no relay can connect to it (the launcher
 *		skips it under '*', waits for it with a list).  Its name is then
 *		returned in *dbname (palloc'd).
 */
OutboxRelayCoverage
outbox_relay_coverage(char **dbname)
{
	char	   *name;
	HeapTuple	tuple;
	bool		servable = true;

	if (outbox_shared == NULL)
		return OUTBOX_NOT_PRELOADED;
	name = get_database_name(MyDatabaseId);
	if (name == NULL)
		return OUTBOX_RELAYED;
	*dbname = name;
	if (!outbox_database_relayed(name))
		return OUTBOX_OTHER_DATABASE;
	tuple = SearchSysCache1(DATABASEOID, ObjectIdGetDatum(MyDatabaseId));
	if (HeapTupleIsValid(tuple))
	{
		Form_pg_database row = (Form_pg_database) GETSTRUCT(tuple);

		servable = row->datallowconn && !row->datistemplate;
		ReleaseSysCache(tuple);
	}
	return servable ? OUTBOX_RELAYED : OUTBOX_UNSERVABLE_DATABASE;
}

/*
 * outbox_wait_event
 *		The wait_event_info for WaitLatch() while the relay waits for one
 *		OutboxWait reason.  On PostgreSQL 17 and later it names the reason in
 *		pg_stat_activity (wait_event_type "Extension", wait_event e.g.
 *		"OutboxIdle"); before 17 it is the generic "Extension".  Registered
 *		in shared memory on first use, then cached for the process's life.
 */
uint32
outbox_wait_event(OutboxWait wait)
{
	static uint32 wait_events[OUTBOX_WAIT_COUNT];

	Assert(wait >= 0 && wait < OUTBOX_WAIT_COUNT);
	if (wait_events[wait] == 0)
		wait_events[wait] = outbox_new_wait_event(wait_event_names[wait]);
	return wait_events[wait];
}

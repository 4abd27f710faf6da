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
 * outbox_shared stays NULL and every function here is a no-op.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"

#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/timestamp.h"

OutboxShared *outbox_shared = NULL;

/* the hooks installed before ours (set by _PG_init) */
shmem_request_hook_type outbox_prev_shmem_request_hook = NULL;
shmem_startup_hook_type outbox_prev_shmem_startup_hook = NULL;

static void outbox_shared_unregister_worker(int code, Datum arg);

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
	RequestAddinShmemSpace(MAXALIGN(sizeof(OutboxShared)));
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

	if (outbox_prev_shmem_startup_hook)
		outbox_prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	outbox_shared = ShmemInitStruct("outbox relay", sizeof(OutboxShared), &found);
	if (!found)
	{
		memset(outbox_shared, 0, sizeof(OutboxShared));
		SpinLockInit(&outbox_shared->mutex);
	}
	LWLockRelease(AddinShmemInitLock);
}

/*
 * outbox_shared_register_worker
 *		Publish the calling relay worker (pid, latch, database) and reset the
 *		counters.  Cleared again when the worker exits.
 */
void
outbox_shared_register_worker(void)
{
	if (outbox_shared == NULL)
		return;

	SpinLockAcquire(&outbox_shared->mutex);
	outbox_shared->worker_pid = MyProcPid;
	outbox_shared->worker_latch = MyLatch;
	outbox_shared->database_oid = MyDatabaseId;
	strlcpy(outbox_shared->database_name, outbox_database, NAMEDATALEN);
	outbox_shared->started_at = GetCurrentTimestamp();
	outbox_shared->state = OUTBOX_STATE_STARTING;
	outbox_shared->published = 0;
	outbox_shared->failed = 0;
	outbox_shared->delivery_errors = 0;
	outbox_shared->last_publish_at = 0;
	outbox_shared->last_error_at = 0;
	outbox_shared->last_error[0] = '\0';
	SpinLockRelease(&outbox_shared->mutex);

	before_shmem_exit(outbox_shared_unregister_worker, (Datum) 0);
}

static void
outbox_shared_unregister_worker(int code, Datum arg)
{
	SpinLockAcquire(&outbox_shared->mutex);
	if (outbox_shared->worker_pid == MyProcPid)
	{
		outbox_shared->worker_pid = 0;
		outbox_shared->worker_latch = NULL;
		outbox_shared->database_oid = InvalidOid;
	}
	SpinLockRelease(&outbox_shared->mutex);
}

/*
 * outbox_wake_worker
 *		Set the relay worker's latch if it serves the current database.
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
	Latch	   *latch = NULL;

	if (outbox_shared == NULL)
		return;
	SpinLockAcquire(&outbox_shared->mutex);
	if (control)
		outbox_shared->control_seq++;
	/* a paused relay has no use for a wake-up per commit (see worker.c) */
	if (outbox_shared->worker_pid != 0 &&
		outbox_shared->database_oid == MyDatabaseId &&
		(control || outbox_shared->state != OUTBOX_STATE_PAUSED))
		latch = outbox_shared->worker_latch;
	SpinLockRelease(&outbox_shared->mutex);

	if (latch != NULL)
		SetLatch(latch);
}

/*
 * outbox_control_seq
 *		How many control commits (see outbox_wake_worker) there have been.
 */
uint32
outbox_control_seq(void)
{
	uint32		seq;

	SpinLockAcquire(&outbox_shared->mutex);
	seq = outbox_shared->control_seq;
	SpinLockRelease(&outbox_shared->mutex);
	return seq;
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

/*-------------------------------------------------------------------------
 *
 * inbox_workers.c
 *	  The pool of inbox workers in the inbox's shared memory (inbox_shmem.c):
 *	  outbox.inbox_max_workers entries, each an inbox worker that applies
 *	  one slice of one subscription's partitions.
 *
 * An inbox launcher claims an entry for a subscription's slice before it
 * starts the worker, and releases it once the worker has exited, so an
 * entry also shows a worker that could not start (waiting_for_worker,
 * max_worker_processes used up).  The worker fills in its pid and latch,
 * and keeps its state, counters and last error there for
 * outbox.inbox_status and outbox.cluster_status().  Each entry has its own
 * spinlock, held for a copy only.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/inbox_shmem.h"

#include "miscadmin.h"
#include "storage/ipc.h"
#include "utils/timestamp.h"

static uint32 inbox_my_generation = 0;

/* dead letters since the calling worker last applied an event, the last's error */
static int64 dead_in_a_row = 0;
static char last_dead_error[OUTBOX_ERROR_LEN];

static void inbox_worker_unregister(int code, Datum arg);

/*
 * inbox_worker_claim
 *		Inbox launcher: take a free entry for slice of nslices of
 *		subscription in database dboid; returns its index (and, in
 *		*generation, the claim's number, which its release must name), or -1
 *		when all outbox.inbox_max_workers are in use.
 */
int
inbox_worker_claim(Oid dboid, const char *subscription, int slice, int nslices,
				   uint32 *generation)
{
	int			i;

	if (inbox_shared == NULL)
		return -1;
	for (i = 0; i < inbox_shared->nworkers; i++)
	{
		InboxWorkerShared *w = &inbox_shared->workers[i];
		bool		taken = false;

		SpinLockAcquire(&w->mutex);
		if (!w->in_use)
		{
			w->in_use = true;
			*generation = ++w->generation;
			w->launcher_slot = inbox_my_slot;
			w->dboid = dboid;
			strlcpy(w->subscription, subscription, NAMEDATALEN);
			w->slice = slice;
			w->nslices = nslices;
			w->pid = 0;
			w->latch = NULL;
			w->state = INBOX_STATE_STARTING;
			w->applied = w->dead = w->errors = 0;
			w->started_at = w->last_applied_at = w->last_error_at = 0;
			w->last_error[0] = '\0';
			taken = true;
		}
		SpinLockRelease(&w->mutex);
		if (taken)
			return i;
	}
	return -1;
}

/*
 * inbox_worker_release
 *		Free entry if it is still the claim generation: called by the
 *		worker as it exits and by its launcher once it saw it exit (or when
 *		it never started), so that an entry is freed even when one of the
 *		two cannot, and never once a later claim took it.
 */
void
inbox_worker_release(int entry, uint32 generation)
{
	InboxWorkerShared *w;

	if (inbox_shared == NULL || entry < 0 || entry >= inbox_shared->nworkers)
		return;
	w = &inbox_shared->workers[entry];
	SpinLockAcquire(&w->mutex);
	if (w->generation == generation)
	{
		w->in_use = false;
		w->pid = 0;
		w->latch = NULL;
	}
	SpinLockRelease(&w->mutex);
}

/*
 * inbox_worker_set_waiting
 *		Inbox launcher: the worker of entry could not be started (error says
 *		why); the entry shows waiting_for_worker until it is.
 */
void
inbox_worker_set_waiting(int entry, const char *error)
{
	InboxWorkerShared *w;
	TimestampTz now = GetCurrentTimestamp();

	if (inbox_shared == NULL || entry < 0 || entry >= inbox_shared->nworkers)
		return;
	w = &inbox_shared->workers[entry];
	SpinLockAcquire(&w->mutex);
	w->state = INBOX_STATE_WAITING_FOR_WORKER;
	strlcpy(w->last_error, error, OUTBOX_ERROR_LEN);
	w->last_error_at = now;
	SpinLockRelease(&w->mutex);
}

/*
 * inbox_worker_register
 *		The calling inbox worker takes up entry (its launcher claimed it as
 *		generation): pid and latch, counters from zero.  Exits at once
 *		(code 0) when the claim is no longer current.  The entry is freed at
 *		exit.
 */
void
inbox_worker_register(int entry, uint32 generation)
{
	InboxWorkerShared *w;

	if (inbox_shared == NULL || entry < 0 || entry >= inbox_shared->nworkers)
		elog(FATAL, "outbox inbox worker started with entry %d of %d", entry,
			 inbox_shared ? inbox_shared->nworkers : 0);
	w = &inbox_shared->workers[entry];
	SpinLockAcquire(&w->mutex);
	if (!w->in_use || w->generation != generation)
	{
		SpinLockRelease(&w->mutex);
		proc_exit(0);
	}
	inbox_my_entry = entry;
	inbox_my_generation = generation;
	w->pid = MyProcPid;
	w->latch = MyLatch;
	w->state = INBOX_STATE_STARTING;
	w->applied = w->dead = w->errors = 0;
	w->started_at = GetCurrentTimestamp();
	w->last_applied_at = w->last_error_at = 0;
	w->last_error[0] = '\0';
	SpinLockRelease(&w->mutex);
	before_shmem_exit(inbox_worker_unregister, (Datum) 0);
}

/* at exit: unpublish the partitions and free the entry */
static void
inbox_worker_unregister(int code, Datum arg)
{
	inbox_status_release_all();
	inbox_worker_release(inbox_my_entry, inbox_my_generation);
}

/*
 * inbox_set_state
 *		The calling inbox worker's state; error, if not NULL, becomes its
 *		last error (the caller makes sure it holds no secret); running
 *		without an error clears it.
 */
void
inbox_set_state(InboxState state, const char *error)
{
	InboxWorkerShared *w;
	TimestampTz now = GetCurrentTimestamp();

	if (inbox_my_entry < 0)
		return;
	w = &inbox_shared->workers[inbox_my_entry];
	SpinLockAcquire(&w->mutex);
	w->state = state;
	if (error != NULL)
	{
		strlcpy(w->last_error, error, OUTBOX_ERROR_LEN);
		w->last_error_at = now;
	}
	else if (state == INBOX_STATE_RUNNING || state == INBOX_STATE_PAUSED)
		w->last_error[0] = '\0';
	SpinLockRelease(&w->mutex);
}

/*
 * inbox_count
 *		Add a batch's records applied, dead letters and failed handler calls
 *		to the calling worker's counters.
 */
void
inbox_count(int64 applied, int64 dead, int64 errors)
{
	InboxWorkerShared *w;
	TimestampTz now = GetCurrentTimestamp();

	if (inbox_my_entry < 0)
		return;
	w = &inbox_shared->workers[inbox_my_entry];
	SpinLockAcquire(&w->mutex);
	w->applied += applied;
	w->dead += dead;
	w->errors += errors;
	if (applied > 0)
		w->last_applied_at = now;
	SpinLockRelease(&w->mutex);
	if (applied > 0)
		dead_in_a_row = 0;
}

/*
 * inbox_note_dead
 *		The calling worker made an event a dead letter, for error (its
 *		handler's message): counted towards the failing state.
 */
void
inbox_note_dead(const char *error)
{
	dead_in_a_row++;
	strlcpy(last_dead_error, error ? error : "", sizeof(last_dead_error));
}

/*
 * inbox_failing
 *		Did the calling worker's last in_a_row events or more all become
 *		dead letters, none applied since?  If so, why (len bytes), with the
 *		last handler error.
 */
bool
inbox_failing(int in_a_row, char *why, size_t len)
{
	if (dead_in_a_row < in_a_row)
		return false;
	snprintf(why, len, "the last %lld events all became dead letters, none was applied since; the last error: %s",
			 (long long) dead_in_a_row, last_dead_error);
	return true;
}

/*
 * inbox_shmem_copy_worker
 *		Status readers (inbox_status.c): copy entry under its lock.  False if
 *		it is out of range or not in use.
 */
bool
inbox_shmem_copy_worker(int entry, InboxWorkerCopy *out)
{
	InboxWorkerShared *w;
	bool		used;

	if (inbox_shared == NULL || entry < 0 || entry >= inbox_shared->nworkers)
		return false;
	w = &inbox_shared->workers[entry];
	SpinLockAcquire(&w->mutex);
	used = w->in_use;
	if (used)
	{
		out->dboid = w->dboid;
		out->launcher_slot = w->launcher_slot;
		strlcpy(out->subscription, w->subscription, NAMEDATALEN);
		out->slice = w->slice;
		out->nslices = w->nslices;
		out->pid = w->pid;
		out->state = w->state;
		out->applied = w->applied;
		out->dead = w->dead;
		out->errors = w->errors;
		out->started_at = w->started_at;
		out->last_applied_at = w->last_applied_at;
		out->last_error_at = w->last_error_at;
		strlcpy(out->last_error, w->last_error, OUTBOX_ERROR_LEN);
	}
	SpinLockRelease(&w->mutex);
	return used;
}

/*
 * inbox_shmem_nworkers
 *		Size of the pool (outbox.inbox_max_workers).
 */
int
inbox_shmem_nworkers(void)
{
	return inbox_shared ? inbox_shared->nworkers : 0;
}

/*-------------------------------------------------------------------------
 *
 * inbox_shmem.c
 *	  Shared-memory state of the inbox workers.
 *
 * An inbox worker runs in a slot of outbox_shared (shmem.c), the same
 * outbox.max_workers slots the relays run in, marked inbox there so that
 * the relays' code passes it by.  What only the inbox has lives here, in
 * an area of its own:
 *	- per slot: the worker's state, counters and last error, and a control
 *	  counter that subscribe(), seek() and the like bump at commit;
 *	- a pool of INBOX_STATUS_PARTITIONS partition entries: each
 *	  (subscription, topic, partition) a worker consumes, with Kafka's high
 *	  watermark, its state and its last error, for outbox.inbox_status;
 *	- the databases where a subscription committed while no inbox worker
 *	  ran there, for the launcher to start one at once.
 * Every entry has its own spinlock, held for a copy only, so reading the
 * status never keeps a worker waiting.  The pool's functions are in
 * inbox_partitions.c.  The area starts zeroed after a crash
 * restart, like the relays' slots.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/inbox_shmem.h"
#include "config/guc.h"
#include "shared/shmem.h"

#include "access/xact.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/timestamp.h"


InboxShared *inbox_shared = NULL;
int			inbox_my_slot = -1;
static bool wake_callback_registered = false;
static bool wake_at_commit = false;

static void inbox_shmem_unregister(int code, Datum arg);
static void inbox_xact_callback(XactEvent event, void *arg);

/*
 * outbox_inbox_shmem_size
 *		Bytes the inbox asks for, with outbox.max_workers slots (shmem.c adds
 *		them to its request).
 */
Size
outbox_inbox_shmem_size(void)
{
	Size		size = MAXALIGN(sizeof(InboxShared));

	size = add_size(size, MAXALIGN(mul_size(sizeof(InboxWorkerShared), outbox_max_workers)));
	size = add_size(size, mul_size(sizeof(InboxPartitionShared), INBOX_STATUS_PARTITIONS));
	return size;
}

/*
 * outbox_inbox_shmem_init
 *		Create or attach to the inbox's area; called by shmem.c's startup
 *		hook with AddinShmemInitLock held.
 */
void
outbox_inbox_shmem_init(void)
{
	bool		found;
	char	   *base;
	int			i;

	inbox_shared = ShmemInitStruct("outbox inbox", outbox_inbox_shmem_size(), &found);
	if (found)
		return;
	base = (char *) inbox_shared;
	memset(base, 0, outbox_inbox_shmem_size());
	SpinLockInit(&inbox_shared->mutex);
	inbox_shared->nworkers = outbox_max_workers;
	inbox_shared->workers = (InboxWorkerShared *) (base + MAXALIGN(sizeof(InboxShared)));
	inbox_shared->partitions = (InboxPartitionShared *)
		(base + MAXALIGN(sizeof(InboxShared)) +
		 MAXALIGN(sizeof(InboxWorkerShared) * outbox_max_workers));
	for (i = 0; i < outbox_max_workers; i++)
		SpinLockInit(&inbox_shared->workers[i].mutex);
	for (i = 0; i < INBOX_STATUS_PARTITIONS; i++)
	{
		SpinLockInit(&inbox_shared->partitions[i].mutex);
		inbox_shared->partitions[i].owner = -1;
	}
}

/*
 * inbox_shmem_register
 *		Publish the calling inbox worker in slot (given by the launcher):
 *		pid, latch and database in outbox_shared, fresh counters here.
 *		Undone when the worker exits.
 */
void
inbox_shmem_register(int slot)
{
	OutboxRelaySlot *s;
	InboxWorkerShared *w;

	if (outbox_shared == NULL || inbox_shared == NULL)
		return;
	if (slot < 0 || slot >= outbox_shared->nslots)
		elog(FATAL, "outbox inbox started with slot %d of %d", slot,
			 outbox_shared->nslots);
	inbox_my_slot = slot;
	s = &outbox_shared->slots[slot];
	SpinLockAcquire(&s->mutex);
	s->inbox = true;
	s->worker_pid = MyProcPid;
	s->worker_latch = MyLatch;
	s->database_oid = MyDatabaseId;
	s->started_at = GetCurrentTimestamp();
	s->connected = true;
	SpinLockRelease(&s->mutex);

	w = &inbox_shared->workers[slot];
	SpinLockAcquire(&w->mutex);
	w->no_subscriptions = false;
	w->serving = false;
	w->state = INBOX_STATE_STARTING;
	w->applied = w->dead = w->errors = 0;
	w->last_applied_at = w->last_error_at = 0;
	w->last_error[0] = '\0';
	SpinLockRelease(&w->mutex);

	before_shmem_exit(inbox_shmem_unregister, (Datum) 0);
}

static void
inbox_shmem_unregister(int code, Datum arg)
{
	OutboxRelaySlot *s = &outbox_shared->slots[inbox_my_slot];

	inbox_status_release_all();
	SpinLockAcquire(&s->mutex);
	if (s->worker_pid == MyProcPid)
	{
		s->worker_pid = 0;
		s->worker_latch = NULL;
	}
	SpinLockRelease(&s->mutex);
}

/*
 * inbox_shmem_note_no_subscriptions
 *		Tell the launcher, before exiting with code 0, that this database
 *		has nothing to consume: it starts no inbox worker here again until a
 *		subscription commits (outbox_inbox_wake) or a while has passed.
 */
void
inbox_shmem_note_no_subscriptions(void)
{
	InboxWorkerShared *w;

	if (inbox_my_slot < 0)
		return;
	w = &inbox_shared->workers[inbox_my_slot];
	SpinLockAcquire(&w->mutex);
	w->no_subscriptions = true;
	SpinLockRelease(&w->mutex);
}

/*
 * inbox_shmem_note_serving
 *		The calling worker found subscriptions and stays: from now on the
 *		status views show it (a worker that only looked and exits never
 *		shows).
 */
void
inbox_shmem_note_serving(void)
{
	InboxWorkerShared *w;

	if (inbox_my_slot < 0)
		return;
	w = &inbox_shared->workers[inbox_my_slot];
	SpinLockAcquire(&w->mutex);
	w->serving = true;
	SpinLockRelease(&w->mutex);
}

/*
 * inbox_shmem_slot_idle
 *		Launcher: did the inbox worker that ran in slot exit for want of
 *		subscriptions?  Clears the mark.
 */
bool
inbox_shmem_slot_idle(int slot)
{
	InboxWorkerShared *w = &inbox_shared->workers[slot];
	bool		idle;

	SpinLockAcquire(&w->mutex);
	idle = w->no_subscriptions;
	w->no_subscriptions = false;
	SpinLockRelease(&w->mutex);
	return idle;
}

/*
 * inbox_shmem_control_seq
 *		How many control commits (subscribe, pause, seek, retry, ...) the
 *		calling worker's slot has seen: a change makes it reload.
 */
uint32
inbox_shmem_control_seq(void)
{
	InboxWorkerShared *w;
	uint32		seq;

	if (inbox_my_slot < 0)
		return 0;
	w = &inbox_shared->workers[inbox_my_slot];
	SpinLockAcquire(&w->mutex);
	seq = w->control_seq;
	SpinLockRelease(&w->mutex);
	return seq;
}

/*
 * inbox_set_state
 *		The worker's own state for outbox.cluster_status() and the worker
 *		row of outbox.inbox_worker_partitions(); error, if not NULL, becomes
 *		its last error (the caller makes sure it holds no secret).
 */
void
inbox_set_state(InboxState state, const char *error)
{
	InboxWorkerShared *w;
	TimestampTz now = GetCurrentTimestamp();

	if (inbox_my_slot < 0)
		return;
	w = &inbox_shared->workers[inbox_my_slot];
	SpinLockAcquire(&w->mutex);
	w->state = state;
	if (error != NULL)
	{
		strlcpy(w->last_error, error, OUTBOX_ERROR_LEN);
		w->last_error_at = now;
	}
	else if (state == INBOX_STATE_RUNNING)
		w->last_error[0] = '\0';
	SpinLockRelease(&w->mutex);
}

/*
 * inbox_count
 *		Add a batch's records applied, dead letters and failed attempts to
 *		the worker's counters.
 */
void
inbox_count(int64 applied, int64 dead, int64 errors)
{
	InboxWorkerShared *w;
	TimestampTz now = GetCurrentTimestamp();

	if (inbox_my_slot < 0)
		return;
	w = &inbox_shared->workers[inbox_my_slot];
	SpinLockAcquire(&w->mutex);
	w->applied += applied;
	w->dead += dead;
	w->errors += errors;
	if (applied > 0)
		w->last_applied_at = now;
	SpinLockRelease(&w->mutex);
}

/*
 * outbox_inbox_wake
 *		Make the inbox worker of database dboid reload its subscriptions:
 *		bump its control counter and set its latch.  When none runs there,
 *		ask the launcher to start one.  Called at commit of the SQL API;
 *		raises no error.
 */
void
outbox_inbox_wake(Oid dboid)
{
	bool		found = false;
	int			i;

	if (outbox_shared == NULL || inbox_shared == NULL)
		return;
	for (i = 0; i < outbox_shared->nslots; i++)
	{
		OutboxRelaySlot *s = &outbox_shared->slots[i];
		Latch	   *latch = NULL;

		SpinLockAcquire(&s->mutex);
		if (s->inbox && s->database_oid == dboid && s->worker_latch != NULL)
			latch = s->worker_latch;
		SpinLockRelease(&s->mutex);
		if (latch == NULL)
			continue;
		SpinLockAcquire(&inbox_shared->workers[i].mutex);
		inbox_shared->workers[i].control_seq++;
		SpinLockRelease(&inbox_shared->workers[i].mutex);
		SetLatch(latch);
		found = true;
	}
	if (found)
		return;
	SpinLockAcquire(&inbox_shared->mutex);
	if (inbox_shared->nrequests < INBOX_MAX_REQUESTS)
		inbox_shared->requests[inbox_shared->nrequests++] = dboid;
	else
		inbox_shared->requests_overflow = true;
	SpinLockRelease(&inbox_shared->mutex);
	outbox_wake_launcher();
}

/*
 * outbox_inbox_wake_at_commit
 *		Wake this database's inbox worker (outbox_inbox_wake) when the
 *		current transaction commits; a rollback wakes nobody.
 */
void
outbox_inbox_wake_at_commit(void)
{
	if (!wake_callback_registered)
	{
		RegisterXactCallback(inbox_xact_callback, NULL);
		wake_callback_registered = true;
	}
	wake_at_commit = true;
}

static void
inbox_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
			if (wake_at_commit)
				outbox_inbox_wake(MyDatabaseId);
			wake_at_commit = false;
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			wake_at_commit = false;
			break;
		default:
			break;
	}
}

/*
 * inbox_take_requests
 *		Launcher: the databases where a subscription committed while no
 *		inbox worker ran (up to max OIDs into dboids); returns how many.
 *		*overflow: more did, any database may be one.
 */
int
inbox_take_requests(Oid *dboids, int max, bool *overflow)
{
	int			n;

	if (inbox_shared == NULL)
	{
		*overflow = false;
		return 0;
	}
	SpinLockAcquire(&inbox_shared->mutex);
	n = Min(inbox_shared->nrequests, max);
	memcpy(dboids, inbox_shared->requests, sizeof(Oid) * n);
	*overflow = inbox_shared->requests_overflow || inbox_shared->nrequests > max;
	inbox_shared->nrequests = 0;
	inbox_shared->requests_overflow = false;
	SpinLockRelease(&inbox_shared->mutex);
	return n;
}

/*
 * inbox_shmem_copy_worker
 *		Status readers (inbox_status.c): copy the entry of slot under its
 *		lock.  False if slot is out of range.
 */
bool
inbox_shmem_copy_worker(int slot, InboxWorkerCopy *out)
{
	InboxWorkerShared *w;

	if (inbox_shared == NULL || slot < 0 || slot >= inbox_shared->nworkers)
		return false;
	w = &inbox_shared->workers[slot];
	SpinLockAcquire(&w->mutex);
	out->serving = w->serving;
	out->state = w->state;
	out->applied = w->applied;
	out->dead = w->dead;
	out->errors = w->errors;
	out->last_applied_at = w->last_applied_at;
	out->last_error_at = w->last_error_at;
	strlcpy(out->last_error, w->last_error, OUTBOX_ERROR_LEN);
	SpinLockRelease(&w->mutex);
	return true;
}


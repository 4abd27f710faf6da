/*-------------------------------------------------------------------------
 *
 * inbox_shmem.c
 *	  Shared-memory state of the inbox workers.
 *
 * A database's inbox launcher runs in a slot of outbox_shared (shmem.c),
 * the same outbox.max_workers slots the relays run in, marked inbox there
 * so that the relays' code passes it by; its inbox workers run in entries
 * of a pool of their own (inbox_workers.c).  What only the inbox has lives
 * here, in an area of its own:
 *	- per slot: the inbox launcher's state and last error, and a control
 *	  counter that subscribe(), seek() and the like bump at commit;
 *	- per pool entry: an inbox worker's subscription and slice, its state,
 *	  counters and last error, and its own control counter;
 *	- a pool of INBOX_STATUS_PARTITIONS partition entries: each
 *	  (subscription, topic, partition) a worker consumes, with Kafka's high
 *	  watermark, its state and its last error, for outbox.inbox_status
 *	  (inbox_partitions.c);
 *	- the databases where a subscription committed while no inbox launcher
 *	  ran there, for the launcher to start one at once.
 * Every entry has its own spinlock, held for a copy only, so reading the
 * status never keeps a worker waiting.  The area starts zeroed after a
 * crash restart, like the relays' slots.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/inbox_shmem.h"
#include "config/guc.h"
#include "config/inbox_guc.h"
#include "shared/shmem.h"

#include "access/xact.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/timestamp.h"


InboxShared *inbox_shared = NULL;
int			inbox_my_slot = -1;
int			inbox_my_entry = -1;
static bool wake_callback_registered = false;
static bool wake_at_commit = false;

static void inbox_shmem_unregister(int code, Datum arg);
static void inbox_xact_callback(XactEvent event, void *arg);

/*
 * outbox_inbox_shmem_size
 *		Bytes the inbox asks for, with outbox.max_workers launcher slots and
 *		outbox.inbox_max_workers worker entries (shmem.c adds them to its
 *		request).
 */
Size
outbox_inbox_shmem_size(void)
{
	Size		size = MAXALIGN(sizeof(InboxShared));

	size = add_size(size, MAXALIGN(mul_size(sizeof(InboxLauncherShared), outbox_max_workers)));
	size = add_size(size, MAXALIGN(mul_size(sizeof(InboxWorkerShared), outbox_inbox_max_workers)));
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
	base += MAXALIGN(sizeof(InboxShared));
	inbox_shared->nlaunchers = outbox_max_workers;
	inbox_shared->launchers = (InboxLauncherShared *) base;
	base += MAXALIGN(sizeof(InboxLauncherShared) * outbox_max_workers);
	inbox_shared->nworkers = outbox_inbox_max_workers;
	inbox_shared->workers = (InboxWorkerShared *) base;
	base += MAXALIGN(sizeof(InboxWorkerShared) * outbox_inbox_max_workers);
	inbox_shared->partitions = (InboxPartitionShared *) base;
	for (i = 0; i < outbox_max_workers; i++)
		SpinLockInit(&inbox_shared->launchers[i].mutex);
	for (i = 0; i < outbox_inbox_max_workers; i++)
		SpinLockInit(&inbox_shared->workers[i].mutex);
	for (i = 0; i < INBOX_STATUS_PARTITIONS; i++)
	{
		SpinLockInit(&inbox_shared->partitions[i].mutex);
		inbox_shared->partitions[i].owner = -1;
	}
}

/*
 * inbox_shmem_register
 *		Publish the calling inbox launcher in slot (given by the launcher):
 *		pid, latch and database in outbox_shared, a fresh state here.
 *		Undone when it exits.
 */
void
inbox_shmem_register(int slot)
{
	OutboxRelaySlot *s;
	InboxLauncherShared *l;

	if (outbox_shared == NULL || inbox_shared == NULL)
		return;
	if (slot < 0 || slot >= outbox_shared->nslots)
		elog(FATAL, "outbox inbox launcher started with slot %d of %d", slot,
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

	l = &inbox_shared->launchers[slot];
	SpinLockAcquire(&l->mutex);
	l->no_subscriptions = false;
	l->serving = false;
	l->state = INBOX_STATE_STARTING;
	l->last_error_at = 0;
	l->last_error[0] = '\0';
	SpinLockRelease(&l->mutex);

	before_shmem_exit(inbox_shmem_unregister, (Datum) 0);
}

static void
inbox_shmem_unregister(int code, Datum arg)
{
	OutboxRelaySlot *s = &outbox_shared->slots[inbox_my_slot];

	SpinLockAcquire(&s->mutex);
	if (s->worker_pid == MyProcPid)
	{
		s->worker_pid = 0;
		s->worker_latch = NULL;
	}
	SpinLockRelease(&s->mutex);
}

/* the calling inbox launcher's entry, or NULL */
static InboxLauncherShared *
my_launcher(void)
{
	if (inbox_my_slot < 0 || inbox_shared == NULL)
		return NULL;
	return &inbox_shared->launchers[inbox_my_slot];
}

/*
 * inbox_shmem_note_no_subscriptions
 *		Tell the launcher, before exiting with code 0, that this database
 *		has nothing to consume: it starts no inbox launcher here again until
 *		a subscription commits (outbox_inbox_wake) or a while has passed.
 *		seen_seq is the control counter the caller read its subscriptions
 *		at: false, and nothing noted, when a control commit came since (a
 *		subscribe() while the caller stopped its workers): the caller must
 *		read them again instead of exiting.
 */
bool
inbox_shmem_note_no_subscriptions(uint32 seen_seq)
{
	InboxLauncherShared *l = my_launcher();
	bool		noted = false;

	if (l == NULL)
		return true;
	SpinLockAcquire(&l->mutex);
	if (l->control_seq == seen_seq)
	{
		l->no_subscriptions = true;
		l->idle_seq = seen_seq;
		noted = true;
	}
	SpinLockRelease(&l->mutex);
	return noted;
}

/*
 * inbox_shmem_note_serving
 *		The calling inbox launcher found subscriptions and stays: from now on
 *		the status views show it (one that only looked and exits never
 *		shows).
 */
void
inbox_shmem_note_serving(void)
{
	InboxLauncherShared *l = my_launcher();

	if (l == NULL)
		return;
	SpinLockAcquire(&l->mutex);
	l->serving = true;
	SpinLockRelease(&l->mutex);
}

/*
 * inbox_shmem_slot_idle
 *		Launcher: did the inbox launcher that ran in slot exit for want of
 *		subscriptions, with no control commit since it looked?  Clears the
 *		mark.
 */
bool
inbox_shmem_slot_idle(int slot)
{
	InboxLauncherShared *l = &inbox_shared->launchers[slot];
	bool		idle;

	SpinLockAcquire(&l->mutex);
	/* a subscription committed after the mark, before the slot was free */
	idle = l->no_subscriptions && l->control_seq == l->idle_seq;
	l->no_subscriptions = false;
	SpinLockRelease(&l->mutex);
	return idle;
}

/*
 * inbox_shmem_control_seq
 *		How many control commits (subscribe, pause, seek, retry, ...) the
 *		calling inbox launcher or inbox worker has seen: a change makes it
 *		look at its subscriptions again.
 */
uint32
inbox_shmem_control_seq(void)
{
	uint32		seq = 0;

	if (inbox_shared == NULL)
		return 0;
	if (inbox_my_entry >= 0)
	{
		InboxWorkerShared *w = &inbox_shared->workers[inbox_my_entry];

		SpinLockAcquire(&w->mutex);
		seq = w->control_seq;
		SpinLockRelease(&w->mutex);
	}
	else if (inbox_my_slot >= 0)
	{
		InboxLauncherShared *l = &inbox_shared->launchers[inbox_my_slot];

		SpinLockAcquire(&l->mutex);
		seq = l->control_seq;
		SpinLockRelease(&l->mutex);
	}
	return seq;
}

/*
 * inbox_launcher_set_state
 *		The inbox launcher's own state (running, or waiting_for_worker while
 *		a subscription has no worker) and, if error is not NULL, its last
 *		error; running without an error clears it.
 */
void
inbox_launcher_set_state(InboxState state, const char *error)
{
	InboxLauncherShared *l = my_launcher();
	TimestampTz now = GetCurrentTimestamp();

	if (l == NULL)
		return;
	SpinLockAcquire(&l->mutex);
	l->state = state;
	if (error != NULL)
	{
		strlcpy(l->last_error, error, OUTBOX_ERROR_LEN);
		l->last_error_at = now;
	}
	else if (state == INBOX_STATE_RUNNING)
		l->last_error[0] = '\0';
	SpinLockRelease(&l->mutex);
}

/*
 * inbox_shmem_copy_launcher
 *		Status readers (inbox_status.c): copy slot's entry under its lock.
 *		False if slot is out of range.
 */
bool
inbox_shmem_copy_launcher(int slot, InboxLauncherCopy *out)
{
	InboxLauncherShared *l;

	if (inbox_shared == NULL || slot < 0 || slot >= inbox_shared->nlaunchers)
		return false;
	l = &inbox_shared->launchers[slot];
	SpinLockAcquire(&l->mutex);
	out->serving = l->serving;
	out->state = l->state;
	out->last_error_at = l->last_error_at;
	strlcpy(out->last_error, l->last_error, OUTBOX_ERROR_LEN);
	SpinLockRelease(&l->mutex);
	return true;
}

/* bump the control counter of every inbox worker of dboid, set their latches */
static void
wake_workers(Oid dboid)
{
	int			i;

	for (i = 0; i < inbox_shared->nworkers; i++)
	{
		InboxWorkerShared *w = &inbox_shared->workers[i];
		Latch	   *latch = NULL;

		SpinLockAcquire(&w->mutex);
		if (w->in_use && w->dboid == dboid)
		{
			w->control_seq++;
			latch = w->latch;
		}
		SpinLockRelease(&w->mutex);
		if (latch != NULL)
			SetLatch(latch);
	}
}

/*
 * outbox_inbox_wake
 *		Make the inbox launcher and the inbox workers of database dboid look
 *		at their subscriptions again: bump their control counters and set
 *		their latches.  When no inbox launcher runs there, ask the launcher
 *		to start one.  Called at commit of the SQL API; raises no error.
 */
void
outbox_inbox_wake(Oid dboid)
{
	bool		found = false;
	int			i;

	if (outbox_shared == NULL || inbox_shared == NULL)
		return;
	wake_workers(dboid);
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
		SpinLockAcquire(&inbox_shared->launchers[i].mutex);
		inbox_shared->launchers[i].control_seq++;
		SpinLockRelease(&inbox_shared->launchers[i].mutex);
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
 *		Wake this database's inbox (outbox_inbox_wake) when the current
 *		transaction commits; a rollback wakes nobody.
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
 *		inbox launcher ran (up to max OIDs into dboids); returns how many.
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

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
 * status never keeps a worker waiting.  The area starts zeroed after a crash
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

/* partition entries for the whole server; more partitions show no live state */
#define INBOX_STATUS_PARTITIONS		512
/* databases a subscription woke while no inbox worker ran there */
#define INBOX_MAX_REQUESTS			16

typedef struct InboxWorkerShared
{
	slock_t		mutex;
	uint32		control_seq;	/* bumped at commit of the SQL API */
	bool		no_subscriptions;	/* the worker exits: nothing to consume */
	bool		serving;		/* it found subscriptions (a probe never does) */
	InboxState	state;
	int64		applied;		/* since the worker started */
	int64		dead;
	int64		errors;
	TimestampTz last_applied_at;
	TimestampTz last_error_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxWorkerShared;

typedef struct InboxPartitionShared
{
	slock_t		mutex;
	int			owner;			/* slot of the worker using it; -1: free */
	pid_t		pid;
	Oid			dboid;
	char		subscription[NAMEDATALEN];
	char		topic[OUTBOX_TOPIC_MAX_LEN + 1];
	int32		partition;
	int64		high_watermark; /* -1: not known yet */
	InboxState	state;
	TimestampTz last_error_at;
	TimestampTz last_applied_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxPartitionShared;

typedef struct InboxShared
{
	slock_t		mutex;			/* protects the requests */
	int			nrequests;
	bool		requests_overflow;
	Oid			requests[INBOX_MAX_REQUESTS];
	int			nworkers;
	InboxWorkerShared *workers; /* nworkers of them */
	InboxPartitionShared *partitions;	/* INBOX_STATUS_PARTITIONS */
} InboxShared;

static InboxShared *inbox_shared = NULL;
static int	my_slot = -1;
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
	my_slot = slot;
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
	OutboxRelaySlot *s = &outbox_shared->slots[my_slot];

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

	if (my_slot < 0)
		return;
	w = &inbox_shared->workers[my_slot];
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

	if (my_slot < 0)
		return;
	w = &inbox_shared->workers[my_slot];
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

	if (my_slot < 0)
		return 0;
	w = &inbox_shared->workers[my_slot];
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

	if (my_slot < 0)
		return;
	w = &inbox_shared->workers[my_slot];
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

	if (my_slot < 0)
		return;
	w = &inbox_shared->workers[my_slot];
	SpinLockAcquire(&w->mutex);
	w->applied += applied;
	w->dead += dead;
	w->errors += errors;
	if (applied > 0)
		w->last_applied_at = now;
	SpinLockRelease(&w->mutex);
}

/*
 * inbox_status_claim
 *		Take a free partition entry for (subscription, topic, partition) of
 *		the calling worker (partition -1: a topic that does not exist yet);
 *		returns its index, or -1 when the pool is used up (the partition
 *		then shows no live state).
 */
int
inbox_status_claim(const char *subscription, const char *topic, int32 partition)
{
	int			i;

	if (my_slot < 0)
		return -1;
	for (i = 0; i < INBOX_STATUS_PARTITIONS; i++)
	{
		InboxPartitionShared *p = &inbox_shared->partitions[i];
		bool		taken = false;

		SpinLockAcquire(&p->mutex);
		if (p->owner < 0)
		{
			p->owner = my_slot;
			p->pid = MyProcPid;
			p->dboid = MyDatabaseId;
			strlcpy(p->subscription, subscription, NAMEDATALEN);
			strlcpy(p->topic, topic, sizeof(p->topic));
			p->partition = partition;
			p->high_watermark = -1;
			p->state = partition < 0 ? INBOX_STATE_WAITING_FOR_TOPIC : INBOX_STATE_STARTING;
			p->last_error[0] = '\0';
			p->last_error_at = p->last_applied_at = 0;
			taken = true;
		}
		SpinLockRelease(&p->mutex);
		if (taken)
			return i;
	}
	return -1;
}

/*
 * inbox_status_release_all
 *		Free every partition entry of the calling worker: at exit, and
 *		before it reloads its subscriptions.
 */
void
inbox_status_release_all(void)
{
	int			i;

	if (my_slot < 0 || inbox_shared == NULL)
		return;
	for (i = 0; i < INBOX_STATUS_PARTITIONS; i++)
	{
		InboxPartitionShared *p = &inbox_shared->partitions[i];

		SpinLockAcquire(&p->mutex);
		if (p->owner == my_slot && p->pid == MyProcPid)
			p->owner = -1;
		SpinLockRelease(&p->mutex);
	}
}

/*
 * inbox_status_set
 *		Partition entry's state and, if error is not NULL, its last error.
 *		A negative entry (no entry) is ignored.
 */
void
inbox_status_set(int entry, InboxState state, const char *error)
{
	InboxPartitionShared *p;
	TimestampTz now = GetCurrentTimestamp();

	if (entry < 0)
		return;
	p = &inbox_shared->partitions[entry];
	SpinLockAcquire(&p->mutex);
	p->state = state;
	if (error != NULL)
	{
		strlcpy(p->last_error, error, OUTBOX_ERROR_LEN);
		p->last_error_at = now;
	}
	SpinLockRelease(&p->mutex);
}

/*
 * inbox_status_watermark
 *		Kafka's high watermark (the offset the next record will get) of the
 *		partition of entry.
 */
void
inbox_status_watermark(int entry, int64 high)
{
	InboxPartitionShared *p;

	if (entry < 0)
		return;
	p = &inbox_shared->partitions[entry];
	SpinLockAcquire(&p->mutex);
	p->high_watermark = high;
	SpinLockRelease(&p->mutex);
}

/*
 * inbox_status_applied
 *		The partition of entry applied a batch now: running, error cleared.
 */
void
inbox_status_applied(int entry)
{
	InboxPartitionShared *p;
	TimestampTz now = GetCurrentTimestamp();

	if (entry < 0)
		return;
	p = &inbox_shared->partitions[entry];
	SpinLockAcquire(&p->mutex);
	p->state = INBOX_STATE_RUNNING;
	p->last_applied_at = now;
	SpinLockRelease(&p->mutex);
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
 * inbox_shmem_copy_worker / inbox_shmem_copy_partition
 *		Status readers (inbox_status.c): copy the entry of slot, or pool
 *		entry i, under its lock.  False if it is not in use.
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

bool
inbox_shmem_copy_partition(int i, InboxPartitionCopy *out)
{
	InboxPartitionShared *p;
	bool		used;

	if (inbox_shared == NULL || i < 0 || i >= INBOX_STATUS_PARTITIONS)
		return false;
	p = &inbox_shared->partitions[i];
	SpinLockAcquire(&p->mutex);
	used = p->owner >= 0;
	if (used)
	{
		out->pid = p->pid;
		out->dboid = p->dboid;
		strlcpy(out->subscription, p->subscription, NAMEDATALEN);
		strlcpy(out->topic, p->topic, sizeof(out->topic));
		out->partition = p->partition;
		out->high_watermark = p->high_watermark;
		out->state = p->state;
		out->last_error_at = p->last_error_at;
		out->last_applied_at = p->last_applied_at;
		strlcpy(out->last_error, p->last_error, OUTBOX_ERROR_LEN);
	}
	SpinLockRelease(&p->mutex);
	return used;
}

/*
 * inbox_shmem_npartitions
 *		Size of the partition pool.
 */
int
inbox_shmem_npartitions(void)
{
	return INBOX_STATUS_PARTITIONS;
}

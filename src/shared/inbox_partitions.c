/*-------------------------------------------------------------------------
 *
 * inbox_partitions.c
 *	  The pool of partition entries in the inbox's shared memory
 *	  (inbox_shmem.c): each (subscription, topic, partition) an inbox worker
 *	  consumes, with Kafka's high watermark, its state and its last error,
 *	  for outbox.inbox_status.
 *
 * INBOX_STATUS_PARTITIONS entries serve the whole server; a partition
 * beyond them still works, it only shows no live state.  Each entry has
 * its own spinlock, held for a copy only.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/inbox_shmem.h"

#include "miscadmin.h"
#include "utils/timestamp.h"

/*
 * inbox_status_claim
 *		Take a free partition entry for (subscription, topic, partition) of
 *		the calling inbox worker (partition -1: a topic that does not exist yet);
 *		returns its index, or -1 when the pool is used up (the partition
 *		then shows no live state).
 */
int
inbox_status_claim(const char *subscription, const char *topic, int32 partition)
{
	int			i;

	if (inbox_my_entry < 0)
		return -1;
	for (i = 0; i < INBOX_STATUS_PARTITIONS; i++)
	{
		InboxPartitionShared *p = &inbox_shared->partitions[i];
		bool		taken = false;

		SpinLockAcquire(&p->mutex);
		if (p->owner < 0)
		{
			p->owner = inbox_my_entry;
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

	if (inbox_my_entry < 0 || inbox_shared == NULL)
		return;
	for (i = 0; i < INBOX_STATUS_PARTITIONS; i++)
	{
		InboxPartitionShared *p = &inbox_shared->partitions[i];

		SpinLockAcquire(&p->mutex);
		if (p->owner == inbox_my_entry && p->pid == MyProcPid)
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
 * inbox_shmem_copy_partition
 *		Status readers (inbox_status.c): copy pool entry i under its lock.
 *		False if it is not in use.
 */
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

/*-------------------------------------------------------------------------
 *
 * snapshot.h
 *	  Relay v2: the events of a batch, by commit snapshot (snapshot.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_SNAPSHOT_H
#define OUTBOX_SNAPSHOT_H

#include "datatype/timestamp.h"
#include "utils/portal.h"

typedef struct OutboxSnapshotBatch
{
	char	   *prev;			/* progress snapshot (pg_snapshot text) */
	int64		prev_floor;		/* id floor read just before prev */
	char	   *cur;			/* the batch's snapshot */
	int64		cur_floor;		/* id floor read just before cur */
	int64		from;			/* highest id of the batch published so far */
	bool		part_a_done;	/* part A returned its last rows */
	bool		exhausted;		/* part B returned its last rows */
	bool		bytes;			/* outbox.events has payload_bytes (1.6) */
	bool		continued;		/* cur came from relay_progress: the batch
								 * was begun by an earlier transaction */
	int64		first_from;		/* from, as read (exactly_once records it) */
} OutboxSnapshotBatch;

extern bool outbox_snapshot_schema(Oid events_relid);
extern bool outbox_bytes_schema(Oid events_relid);
extern bool outbox_rows_due(void);
extern bool outbox_snapshot_events_exist(void);
extern void outbox_snapshot_adopt(void);
extern struct HTAB *outbox_snapshot_held(void);
extern void outbox_snapshot_demote(Datum *ids, int n);
extern bool outbox_snapshot_oldest_created_before(TimestampTz cutoff);
extern uint64 outbox_aggregate_hash(const char *aggregate_type,
									const char *aggregate_id);
extern void outbox_snapshot_begin(OutboxSnapshotBatch *sb);
extern Portal outbox_snapshot_open(OutboxSnapshotBatch *sb, int limit,
								   bool *part_b);
extern void outbox_snapshot_save(OutboxSnapshotBatch *sb);

#endif							/* OUTBOX_SNAPSHOT_H */

/*-------------------------------------------------------------------------
 *
 * partition.c
 *	  Key-partitioned relays: outbox.workers_per_database relays share one
 *	  database's events by key bucket.
 *
 * An event's bucket is
 *		hashtextextended(aggregate_id, hashtextextended(aggregate_type, 0)) & 255
 * computed from the event row itself (claim.c filters on it), so it is fixed
 * when the event is written and every event of an aggregate has the same
 * one.  Worker j of k serves buckets [j * 256 / k, (j + 1) * 256 / k).  The
 * launcher changes k only between generations: it asks every relay of the
 * database to exit between two batches, and starts the new ones once all
 * have (launcher_relays.c).  So at any time each aggregate has at most one
 * relay, which sends its events in id order, and nothing a relay claimed is
 * left half-sent for another.
 *
 * The relays claim rows (FOR UPDATE SKIP LOCKED, in id order, their buckets
 * only), so with k > 1 new events are tracked row by row, whatever
 * outbox.relay_mode says.  Events already tracked by snapshot are sent by
 * worker 0 in snapshot batches over all buckets; the others' claims stay
 * below the snapshot progress meanwhile (CLAIM_CEILING in claim.c), as
 * after a switch to relay_mode = row.  Worker 0 also runs the retention and
 * the VACUUMs, which serve the whole table.
 *
 * With outbox.delivery = exactly_once each relay has its own transactional
 * id and progress records (exactly_once.c).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/partition.h"
#include "config/guc.h"

/*
 * set by outbox_connect_to_database() in a relay; a backend keeps NULL and
 * 0 of 1
 */
const char *outbox_relay_database = NULL;
int			outbox_relay_worker = 0;
int			outbox_relay_nworkers = 1;

/*
 * outbox_rows_for_new_events
 *		Should a new event be tracked row by row (xid NULL)?  Yes with
 *		outbox.relay_mode = row, and while several relays share a database:
 *		they split the claim of row-tracked events, while a snapshot batch
 *		covers every bucket.
 */
bool
outbox_rows_for_new_events(void)
{
	return outbox_relay_mode == OUTBOX_RELAY_ROW || outbox_workers_per_database > 1;
}

/*
 * outbox_bucket_first
 *		First bucket (0 .. OUTBOX_BUCKETS - 1) of worker j of nworkers; its
 *		last is outbox_bucket_first(j + 1, nworkers) - 1.
 */
int
outbox_bucket_first(int worker, int nworkers)
{
	return worker * OUTBOX_BUCKETS / Max(nworkers, 1);
}

/*
 * outbox_relay_serves_all
 *		Does this relay serve the table as a whole: the snapshot batches, the
 *		retention, the VACUUMs?  Worker 0 does, alone or among k.
 */
bool
outbox_relay_serves_all(void)
{
	return outbox_relay_worker == 0;
}

/*-------------------------------------------------------------------------
 *
 * partition.h
 *	  Which relay this process is (its database, worker j of k) and which
 *	  key buckets it serves (partition.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_PARTITION_H
#define OUTBOX_PARTITION_H

extern const char *outbox_relay_database;	/* name of the relay's database */
extern bool outbox_rows_for_new_events(void);
extern int	outbox_relay_worker;		/* this relay's index j, 0-based */
extern int	outbox_relay_nworkers;		/* k of its database; 1 outside relays */
extern int	outbox_bucket_first(int worker, int nworkers);
extern bool outbox_relay_serves_all(void);

#endif							/* OUTBOX_PARTITION_H */

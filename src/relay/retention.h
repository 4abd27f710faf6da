/*-------------------------------------------------------------------------
 *
 * retention.h
 *	  Retention as worker.c calls it between batches: published events are
 *	  deleted once outbox.retention has passed (retention.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_RETENTION_H
#define OUTBOX_RETENTION_H

extern void outbox_relay_cleanup_if_due(void);

#endif							/* OUTBOX_RETENTION_H */

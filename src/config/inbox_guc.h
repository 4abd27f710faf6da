/*-------------------------------------------------------------------------
 *
 * inbox_guc.h
 *	  The outbox.inbox_* settings (inbox_guc.c), in the units named.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_INBOX_GUC_H
#define OUTBOX_INBOX_GUC_H

extern char *outbox_inbox_bootstrap_servers;	/* '' = outbox.bootstrap_servers */
extern char *outbox_inbox_kafka_properties;	/* consumer properties (real value) */
extern int	outbox_inbox_batch_size;	/* records per apply transaction */
extern int	outbox_inbox_batch_wait;	/* ms to fill a batch */
extern int	outbox_inbox_handler_timeout;	/* ms per handler call; 0 = none */
extern int	outbox_inbox_dedupe_window;	/* s an applied event id is kept */
extern int	outbox_inbox_max_attempts;	/* crashes or transient errors per record */
extern bool outbox_inbox_superuser_subscriptions;	/* allow superuser owners */
extern int	outbox_inbox_workers_per_subscription;	/* apply workers per subscription */
extern int	outbox_inbox_max_workers;	/* apply workers in the server (restart) */

/* the most apply workers one subscription can have */
#define OUTBOX_INBOX_MAX_WORKERS_PER_SUBSCRIPTION	32

extern void outbox_inbox_define_gucs(void);
extern const char *outbox_inbox_servers(void);
extern const char *const *outbox_inbox_reserved_properties(void);

#endif							/* OUTBOX_INBOX_GUC_H */

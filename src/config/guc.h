/*-------------------------------------------------------------------------
 *
 * guc.h
 *	  The outbox.* settings (guc.c) and the values of the enum ones.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_GUC_H
#define OUTBOX_GUC_H

#include "utils/guc.h"

/*
 * The outbox.* settings (guc.c).  Values are in the units named; the GUC
 * machinery converts what the user wrote in postgresql.conf.
 */
extern char *outbox_database;			/* 1.x: the one database relayed */
extern char *outbox_databases;			/* '' = outbox.database; names; '*' */
extern int	outbox_max_workers;			/* relay slots in the whole server */
extern int	outbox_workers_per_database;	/* relays sharing a database */
extern char *outbox_bootstrap_servers;	/* host:port,...; empty = idle */
extern char *outbox_topic_prefix;		/* routed topic = prefix||aggregate_type */
extern int	outbox_batch_size;			/* events per claim */
extern int	outbox_poll_interval;		/* ms between polls without wake-ups */
extern char *outbox_kafka_properties;	/* extra librdkafka key=value;... */
extern int	outbox_retention;			/* s to keep published rows; -1 forever */
extern int	outbox_vacuum_interval;		/* s between the relay's VACUUMs; 0 = off */
extern int	outbox_delivery_timeout;	/* ms: message.timeout.ms */
extern int	outbox_retry_backoff_max;	/* ms: cap of the per-event backoff */
extern int	outbox_max_attempts;		/* permanent failures before "failed" */
extern int	outbox_on_failed_event;		/* OUTBOX_ON_FAILED_* */
extern int	outbox_relay_mode;			/* OUTBOX_RELAY_* */
extern int	outbox_delivery;			/* OUTBOX_DELIVERY_* */
extern char *outbox_progress_topic;	/* exactly_once: the progress topic */
extern char *outbox_allowed_topics;	/* topics emit() accepts; '' = all */
extern char *outbox_role;				/* role the relay runs as; '' = superuser */
extern const char *outbox_allowed_topic_list;	/* outbox.allowed_topics, parsed */
extern int	outbox_message_format;		/* OUTBOX_FORMAT_* */
extern char *outbox_ce_source;			/* CloudEvents source; '' = derived */
extern char *outbox_traceparent;		/* W3C traceparent; '' = none */
extern char *outbox_tracestate;			/* W3C tracestate; '' = none */

/* outbox.on_failed_event: later events of a failed event's aggregate ... */
#define OUTBOX_ON_FAILED_HOLD	0	/* ... wait behind it */
#define OUTBOX_ON_FAILED_SKIP	1	/* ... go on without it */

/* outbox.relay_mode: how emit() marks new events for the relay */
#define OUTBOX_RELAY_ROW		0	/* per-row state (published_at) */
#define OUTBOX_RELAY_SNAPSHOT	1	/* writing transaction (xid), see snapshot.c */

/* outbox.delivery: what a crash may cost consumers */
#define OUTBOX_DELIVERY_AT_LEAST_ONCE	0	/* idempotent producer; resends */
#define OUTBOX_DELIVERY_EXACTLY_ONCE	1	/* Kafka transactions, exactly_once.c */

/* outbox.message_format: the shape of a message */
#define OUTBOX_FORMAT_DEBEZIUM		0	/* JSON value, id/event_type headers */
#define OUTBOX_FORMAT_CLOUDEVENTS	1	/* CloudEvents binary mode, ce_* */

extern void outbox_define_gucs(void);
extern bool outbox_check_bootstrap_servers(char **newval, void **extra,
										   GucSource source);

#endif							/* OUTBOX_GUC_H */

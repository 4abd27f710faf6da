/*-------------------------------------------------------------------------
 *
 * outbox.h
 *	  The limits and names every part of the outbox extension shares.
 *	  Every .c file includes it first (it brings postgres.h and compat.h).
 *
 * The extension has parts that meet in the events table and in shared
 * memory, one folder each (src/README.md draws which uses which):
 *	- write/: the SQL API (emit.c, capture.c) that writes events in the
 *	  caller's transaction and wakes the relay at commit,
 *	- worker/, relay/, exactly_once/, kafka/: the relay worker that
 *	  publishes committed events to Kafka,
 *	- shared/: the shared-memory status through which both sides, the
 *	  launcher (launcher/) and the DBA see each other,
 *	- config/: the outbox.* settings.
 * Declarations of a part live in its own headers (config/guc.h,
 * shared/shmem.h, write/emit.h, ...), not here.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_H
#define OUTBOX_H

#include "postgres.h"

#include "compat.h"

/* Schema and table; the install script creates them, the worker reads them */
#define OUTBOX_SCHEMA			"outbox"
#define OUTBOX_EVENTS_TABLE		"events"
#define OUTBOX_EXTENSION_NAME	"outbox"

/* Kafka's limit on topic names (see Kafka's Topic.validate) */
#define OUTBOX_TOPIC_MAX_LEN	249

/*
 * Longest aggregate_type and aggregate_id (bytes).  Both go into the btree
 * index the relay uses to find failed events of an aggregate, whose entries
 * cannot exceed about 2.7 kB; the aggregate id is also the Kafka key.
 */
#define OUTBOX_AGGREGATE_TYPE_MAX_BYTES	255
#define OUTBOX_AGGREGATE_ID_MAX_BYTES	1024

/* Headers every message carries before the user's own (reserved names) */
#define OUTBOX_HEADER_ID				"id"
#define OUTBOX_HEADER_EVENT_TYPE		"event_type"
#define OUTBOX_HEADER_AGGREGATE_TYPE	"aggregate_type"
/* ... and in the CloudEvents format; ce_id must stay the event id */
#define OUTBOX_HEADER_CE_ID				"ce_id"
#define OUTBOX_HEADER_CE_SPECVERSION	"ce_specversion"

/* Size of the error text kept in shared memory, including the terminator */
#define OUTBOX_ERROR_LEN		256

/*
 * Key buckets (shared/partition.c).  An event's bucket is a hash of its
 * aggregate (type and id), so it is fixed by the event row itself; worker j
 * of the k relays of a database serves buckets [j * 256 / k,
 * (j + 1) * 256 / k).  Every event of an aggregate is served by one worker,
 * whatever k is.
 */
#define OUTBOX_BUCKETS					256
#define OUTBOX_MAX_WORKERS_PER_DATABASE	32

#endif							/* OUTBOX_H */

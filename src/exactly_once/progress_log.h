/*-------------------------------------------------------------------------
 *
 * progress_log.h
 *	  Read back the relay's last committed progress record (exactly_once).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_PROGRESS_LOG_H
#define OUTBOX_PROGRESS_LOG_H

#include "outbox.h"
#include "kafka/producer.h"

/*
 * The last progress records of every relay of the database, as the read
 * back found them: records[n] is relay n + 1's, whose key is database_key
 * (n = 0) or database_key "-w<n + 1>"; NULL if none was read.  records[self]
 * is the reading relay's own.
 */
typedef struct OutboxProgressRecords
{
	const char *database_key;
	int			self;
	char	   *records[OUTBOX_MAX_WORKERS_PER_DATABASE];
} OutboxProgressRecords;

extern bool outbox_progress_read_back(OutboxProducer *producer,
									  const char *topic, const char *key,
									  int timeout_ms,
									  OutboxProgressRecords *records,
									  char **error);

#endif							/* OUTBOX_PROGRESS_LOG_H */

/*-------------------------------------------------------------------------
 *
 * progress_log.h
 *	  Read back the relay's last committed progress record (exactly_once).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_PROGRESS_LOG_H
#define OUTBOX_PROGRESS_LOG_H

#include "producer.h"

extern bool outbox_progress_read_back(OutboxProducer *producer,
									  const char *topic, const char *key,
									  int timeout_ms, char **record,
									  char **error);

#endif							/* OUTBOX_PROGRESS_LOG_H */

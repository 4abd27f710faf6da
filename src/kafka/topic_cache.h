/*-------------------------------------------------------------------------
 *
 * topic_cache.h
 *	  The relay producer's topic handles and the cluster's verdict on each
 *	  topic (topic_cache.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_TOPIC_CACHE_H
#define OUTBOX_TOPIC_CACHE_H

#include <librdkafka/rdkafka.h>

extern struct HTAB *outbox_topic_cache_create(void);
extern void outbox_topic_cache_destroy(struct HTAB *cache);
extern rd_kafka_topic_t *outbox_topic_handle(rd_kafka_t *rk,
											 struct HTAB *cache,
											 const char *name,
											 bool brokers_down,
											 rd_kafka_resp_err_t *error);

#endif							/* OUTBOX_TOPIC_CACHE_H */

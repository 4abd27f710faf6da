/*-------------------------------------------------------------------------
 *
 * topic.h
 *	  Kafka's rules for topic names, and the allowed-topics list.
 *
 * The functions here read no setting: the caller passes the prefix or the
 * parsed list, so guc.c (checking a new value), emit.c (checking an event)
 * and message.c (routing a claimed row) can all use them.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_TOPIC_H
#define OUTBOX_TOPIC_H

#include "nodes/pg_list.h"

extern bool outbox_topic_chars_are_legal(const char *s, size_t len);
extern bool outbox_topic_is_legal(const char *topic, size_t len);
extern bool outbox_topic_prefix_is_legal(const char *prefix, size_t len);
extern bool outbox_topic_is_internal(const char *topic);
extern char *outbox_routed_topic(const char *prefix,
								 const char *aggregate_type);

extern bool outbox_topic_pattern_is_legal(const char *pattern);
extern const char *outbox_topic_list_pack(const List *patterns, char *buf);
extern bool outbox_topic_list_allows(const char *list, const char *topic);

#endif							/* OUTBOX_TOPIC_H */

/*-------------------------------------------------------------------------
 *
 * kafka_config.h
 *	  The rules of outbox.kafka_properties: syntax, reserved, forbidden and
 *	  secret librdkafka properties; the relay's librdkafka configuration.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_KAFKA_CONFIG_H
#define OUTBOX_KAFKA_CONFIG_H

#include <librdkafka/rdkafka.h>

#include "config/guc_refusal.h"

#include "lib/stringinfo.h"
#include "utils/guc.h"

/*
 * Parsed outbox.kafka_properties: parallel arrays of keys and values,
 * palloc'd in the caller's context.
 */
typedef struct OutboxKafkaProperty
{
	char	   *key;
	char	   *value;
} OutboxKafkaProperty;

extern bool outbox_parse_kafka_properties(const char *text,
										  OutboxKafkaProperty **props,
										  int *nprops,
										  char **error);
extern bool outbox_parse_properties(const char *text,
									const char *const *reserved,
									const char *who,
									OutboxKafkaProperty **props,
									int *nprops, char **error);
extern bool outbox_check_properties_setting(char **newval, void **extra,
											GucSource source,
											const char *const *reserved,
											const char *who,
											const char *name,
											OutboxRefusable refusable);
extern bool outbox_kafka_property_is_secret(const char *key);
extern bool outbox_check_kafka_properties(char **newval, void **extra,
										  GucSource source);
extern char *outbox_trim_whitespace(char *s);
extern void outbox_append_kafka_escaped(StringInfo buf, const char *s);
extern rd_kafka_conf_t *outbox_kafka_conf_new(const char *bootstrap_servers,
											  int delivery_timeout_ms,
											  const char *properties,
											  char **error);

#endif							/* OUTBOX_KAFKA_CONFIG_H */

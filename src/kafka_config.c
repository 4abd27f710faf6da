/*-------------------------------------------------------------------------
 *
 * kafka_config.c
 *	  The rules of outbox.kafka_properties: its syntax, and which librdkafka
 *	  properties a user may not set and whose values no one may see.
 *
 * Three lists decide what a key may be:
 *	- reserved: the relay sets them itself, because they carry the delivery
 *	  guarantees or have their own setting; they must agree with the
 *	  defaults the relay sets (default_properties in producer.c);
 *	- forbidden: they would load code or run a command in the server;
 *	- secret: their values never appear in SHOW, pg_settings, the log or a
 *	  message.
 *
 * Nothing here reads a setting or touches librdkafka, so the postmaster can
 * check a new value (guc.c) with the same rules the relay builds its
 * producer with (producer.c).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "kafka_config.h"

#include <ctype.h>

/*
 * Properties that load code or run commands in the server process.  Being
 * allowed to set outbox.kafka_properties (a superuser, or a role granted SET
 * on it) must never amount to running arbitrary code as the postgres user.
 */
static const char *const forbidden_kafka_properties[] = {
	"plugin.library.paths",
	"ssl.engine.location",
	"ssl.engine.id",
	"ssl_engine_callback_data",
	"ssl.providers",
	"sasl.kerberos.kinit.cmd",
	"interceptors",
	NULL
};

/*
 * Parts of property names whose values may be secrets.  Matched anywhere in
 * the name and in any case, so that a newer librdkafka's properties (e.g.
 * sasl.oauthbearer.assertion.private.key.passphrase) and a mistyped name
 * (SASL.PASSWORD, which librdkafka refuses, but the value is shown anyway)
 * are masked too.  A name that only looks secret costs nothing but a
 * masked value.
 */
static const char *const secret_name_parts[] = {
	"password",
	"passphrase",
	"secret",
	"token",
	"credential",
	"private",
	"key.pem",
	"ssl_key",
	"ssl.key",
	"keystore",
	"sasl.oauthbearer.config",
	"sasl.username",
	"url",						/* an endpoint URL may carry user:password@ */
};

/*
 * outbox_kafka_property_is_secret
 *		True if the value of librdkafka property key may be a secret:
 *		passwords and passphrases, secrets and tokens, keys, private keys and
 *		keystores, the SASL user name, OAuth configuration and any URL.  Such
 *		values never appear in SHOW, pg_settings, the log or a message.
 *		Case does not matter.
 */
bool
outbox_kafka_property_is_secret(const char *key)
{
	size_t		i;

	for (i = 0; i < lengthof(secret_name_parts); i++)
	{
		size_t		n = strlen(secret_name_parts[i]);
		const char *p;

		/* no allocation: this also runs in the log hook */
		for (p = key; *p; p++)
		{
			if (pg_strncasecmp(p, secret_name_parts[i], n) == 0)
				return true;
		}
	}
	return false;
}

/*
 * Properties the relay sets itself and a user must not change: they carry
 * the delivery guarantees (acks, idempotence) or have their own GUC.
 */
static const char *const reserved_kafka_properties[] = {
	"bootstrap.servers",
	"metadata.broker.list",
	"enable.idempotence",
	"acks",
	"request.required.acks",
	"message.timeout.ms",
	"delivery.timeout.ms",
	"enable.gapless.guarantee",
	"log.queue",
	/* key -> partition must match the Java client's, and keep an aggregate on one partition */
	"partitioner",
	/* the relay is not a transactional producer */
	"transactional.id",

	/*
	 * librdkafka runs sasl.kerberos.kinit.cmd through the shell, with the
	 * principal and keytab pasted in, whenever this is not 0: a way to run
	 * commands.  The relay sets it to 0; keep the Kerberos ticket cache
	 * fresh outside the server (k5start, cron).
	 */
	"sasl.kerberos.min.time.before.relogin",
	NULL
};

/*
 * outbox_trim_whitespace
 *		Trim the blanks (isspace) around s in place: returns a pointer into
 *		s, whose trailing blanks are overwritten with '\0'.  Serves the
 *		items of outbox.kafka_properties here and those of the comma lists
 *		in guc.c.
 */
char *
outbox_trim_whitespace(char *s)
{
	char	   *end;

	while (*s && isspace((unsigned char) *s))
		s++;
	end = s + strlen(s);
	while (end > s && isspace((unsigned char) end[-1]))
		*--end = '\0';
	return s;
}

/*
 * outbox_parse_kafka_properties
 *		Split "key=value;key=value" into an array of properties.
 *
 * Empty items (";;" or a trailing ";") are ignored and whitespace around
 * keys and values is trimmed.  Values cannot contain ';'.  Returns false
 * with *error set (palloc'd) on a malformed item or a reserved or forbidden
 * key; the librdkafka-level check of each value happens when the worker
 * builds its producer, because librdkafka must not be touched in the
 * postmaster.  Results are palloc'd in the current memory context.
 */
bool
outbox_parse_kafka_properties(const char *text, OutboxKafkaProperty **props,
							  int *nprops, char **error)
{
	char	   *copy = pstrdup(text ? text : "");
	char	   *item;
	char	   *saveptr = NULL;
	int			n = 0;
	int			position = 0;
	int			cap = 8;
	OutboxKafkaProperty *out = palloc(sizeof(OutboxKafkaProperty) * cap);

	for (item = strtok_r(copy, ";", &saveptr); item != NULL;
		 item = strtok_r(NULL, ";", &saveptr))
	{
		char	   *eq;
		char	   *key;
		char	   *value;
		const char *bare;
		int			i;

		item = outbox_trim_whitespace(item);
		if (*item == '\0')
			continue;
		position++;

		/* messages never quote an item or a value: they may be secrets */
		eq = strchr(item, '=');
		if (eq == NULL)
		{
			*error = psprintf("item %d is not of the form key=value", position);
			return false;
		}
		*eq = '\0';
		key = outbox_trim_whitespace(item);
		value = outbox_trim_whitespace(eq + 1);
		if (*key == '\0')
		{
			*error = psprintf("item %d has an empty key", position);
			return false;
		}
		/* librdkafka also takes topic properties as "topic.<name>" */
		bare = pg_strncasecmp(key, "topic.", 6) == 0 ? key + 6 : key;
		for (i = 0; reserved_kafka_properties[i] != NULL; i++)
		{
			if (pg_strcasecmp(key, reserved_kafka_properties[i]) == 0 ||
				pg_strcasecmp(bare, reserved_kafka_properties[i]) == 0)
			{
				*error = psprintf("property \"%s\" is set by the relay itself and cannot be overridden", key);
				return false;
			}
		}
		for (i = 0; forbidden_kafka_properties[i] != NULL; i++)
		{
			if (pg_strcasecmp(key, forbidden_kafka_properties[i]) == 0 ||
				pg_strcasecmp(bare, forbidden_kafka_properties[i]) == 0 ||
				pg_strncasecmp(key, "ssl.engine.", 11) == 0)
			{
				*error = psprintf("property \"%s\" would load code or run a command in the server and is not allowed", key);
				return false;
			}
		}
		if (n == cap)
		{
			cap *= 2;
			out = repalloc(out, sizeof(OutboxKafkaProperty) * cap);
		}
		out[n].key = key;
		out[n].value = value;
		n++;
	}
	*props = out;
	*nprops = n;
	return true;
}

/*-------------------------------------------------------------------------
 *
 * kafka_config.c
 *	  The rules of outbox.kafka_properties: its syntax, and which librdkafka
 *	  properties a user may not set and whose values no one may see; and
 *	  the librdkafka configuration the relay builds from it.
 *
 * Three lists decide what a key may be:
 *	- reserved: the relay sets them itself, because they carry the delivery
 *	  guarantees or have their own setting; they must agree with the
 *	  defaults the relay sets (default_properties, at the end of this file);
 *	- forbidden: they would load code or run a command in the server;
 *	- secret: their values never appear in SHOW, pg_settings, the log or a
 *	  message.
 *
 * Then the configuration the relay's producer is built with
 * (outbox_kafka_conf_new): the relay's own properties and defaults, then
 * the user's.
 *
 * Nothing here reads a setting, and only outbox_kafka_conf_new touches
 * librdkafka (the relay worker calls it, producer.c), so the postmaster can
 * check a new value (guc.c) with the same rules the relay builds its
 * producer with.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/kafka_config.h"
#include "config/guc_refusal.h"

#include <ctype.h>

#include "lib/stringinfo.h"

static bool set_relay_properties(rd_kafka_conf_t *conf,
								 const char *bootstrap_servers,
								 int delivery_timeout_ms, char **error);
static bool set_property(rd_kafka_conf_t *conf, const char *key,
						 const char *value, char **error);

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
 * outbox_check_kafka_properties
 *		The check hook of outbox.kafka_properties (guc.c; source is a
 *		GucSource): reject a malformed value when it is set, so that a typo
 *		is reported by pg_reload_conf()'s log line and the old value stays
 *		in effect.  The error text never includes the values: they may be
 *		secrets.
 *
 * A valid value is kept in *extra, and *newval is replaced with the same
 * properties whose secret values (passwords, keys) read "********": that is
 * all SHOW, current_setting() and every column of pg_settings can display,
 * for every role.  ALTER SYSTEM still writes the value as given.
 */
bool
outbox_check_kafka_properties(char **newval, void **extra, GucSource source)
{
	return outbox_check_properties_setting(newval, extra, source,
										   reserved_kafka_properties, "the relay",
										   "outbox.kafka_properties",
										   OUTBOX_REFUSABLE_KAFKA_PROPERTIES);
}

/*
 * outbox_check_properties_setting
 *		The check hook of a setting of librdkafka properties (name, e.g.
 *		"outbox.kafka_properties"), as outbox_check_kafka_properties
 *		describes, with its own list of reserved keys (NULL-terminated; who
 *		sets them, for the message) and the refusal it notes (guc_refusal.c).
 */
bool
outbox_check_properties_setting(char **newval, void **extra, GucSource source,
								const char *const *reserved, const char *who,
								const char *name, OutboxRefusable refusable)
{
	OutboxKafkaProperty *props;
	int			nprops;
	char	   *error = NULL;
	StringInfoData buf;
	char	   *masked;
	char	   *real;
	int			i;

	if (!outbox_parse_properties(*newval, reserved, who, &props, &nprops, &error))
	{
		/* replaces core's message, which would quote the whole value */
		GUC_check_errmsg("invalid value for parameter \"%s\"", name);
		GUC_check_errdetail("%s: %s.", name, error);
		outbox_note_refusal(refusable, source, error);
		return false;
	}

	/* escaped again: the masked value must read back as the same properties */
	initStringInfo(&buf);
	for (i = 0; i < nprops; i++)
	{
		if (i > 0)
			appendStringInfoChar(&buf, ';');
		outbox_append_kafka_escaped(&buf, props[i].key);
		appendStringInfoChar(&buf, '=');
		if (outbox_kafka_property_is_secret(props[i].key))
			appendStringInfoString(&buf, "********");
		else
			outbox_append_kafka_escaped(&buf, props[i].value);
	}

	/* the GUC machinery frees values and extras (see compat.h) */
	masked = outbox_guc_strdup(buf.data);
	real = outbox_guc_strdup(*newval);
	pfree(buf.data);
	if (masked == NULL || real == NULL)
	{
		if (masked)
			outbox_guc_free(masked);
		if (real)
			outbox_guc_free(real);
		GUC_check_errcode(ERRCODE_OUT_OF_MEMORY);
		GUC_check_errmsg("out of memory");
		return false;
	}
	outbox_guc_free(*newval);
	*newval = masked;
	*extra = real;
	return true;
}

/*
 * Cut the item that starts at *cursor off at its first ';' that is not
 * written "\;" (by overwriting that ';' with '\0'), and move *cursor past
 * it, or to NULL after the last item.  Returns the item, escapes still in.
 */
static char *
next_item(char **cursor)
{
	char	   *item = *cursor;
	char	   *p;

	for (p = item; *p != '\0'; p++)
	{
		if (p[0] == '\\' && (p[1] == ';' || p[1] == '\\'))
			p++;
		else if (*p == ';')
		{
			*p = '\0';
			*cursor = p + 1;
			return item;
		}
	}
	*cursor = NULL;
	return item;
}

/*
 * Undo the escapes of s in place: "\;" is ';' and "\\" is a backslash;
 * any other backslash stays as it is.
 */
static void
unescape(char *s)
{
	char	   *out = s;

	for (; *s != '\0'; s++)
	{
		if (s[0] == '\\' && (s[1] == ';' || s[1] == '\\'))
			s++;
		*out++ = *s;
	}
	*out = '\0';
}

/*
 * outbox_append_kafka_escaped
 *		Append s to buf as a key or value of outbox.kafka_properties is
 *		written: ';' as "\;", and a backslash as "\\" where it would
 *		otherwise be read as an escape (before ';', a backslash or the end);
 *		other backslashes stay single, as the user wrote them.  Parsing the
 *		result gives s back.
 */
void
outbox_append_kafka_escaped(StringInfo buf, const char *s)
{
	for (; *s != '\0'; s++)
	{
		if (*s == ';' ||
			(*s == '\\' && (s[1] == ';' || s[1] == '\\' || s[1] == '\0')))
			appendStringInfoChar(buf, '\\');
		appendStringInfoChar(buf, *s);
	}
}

/*
 * False with *error set (palloc'd) if key is reserved (in reserved, which
 * who sets) or forbidden.
 */
static bool
key_allowed(const char *key, const char *const *reserved, const char *who,
			char **error)
{
	/* librdkafka also takes topic properties as "topic.<name>" */
	const char *bare = pg_strncasecmp(key, "topic.", 6) == 0 ? key + 6 : key;
	int			i;

	for (i = 0; reserved[i] != NULL; i++)
	{
		if (pg_strcasecmp(key, reserved[i]) == 0 ||
			pg_strcasecmp(bare, reserved[i]) == 0)
		{
			*error = psprintf("property \"%s\" is set by %s itself and cannot be overridden", key, who);
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
	return true;
}

/*
 * outbox_parse_kafka_properties
 *		Split "key=value;key=value" into an array of properties.
 *
 * Items are separated by ';'.  In a key or value "\;" stands for a ';' and
 * "\\" for a backslash; any other backslash is kept as it is.  A value
 * runs to the end of its item, so it may hold '=' but never a bare ';'.
 * Whitespace around keys and values is trimmed.  One ';' at the end is
 * allowed; an empty item elsewhere (";;") is refused: it is most likely a
 * ';' of a value that was not escaped.  Returns false with *error set
 * (palloc'd, never quoting a value) on a malformed item or a reserved or
 * forbidden key; the librdkafka-level check of each value happens when the
 * worker builds its producer, because librdkafka must not be touched in
 * the postmaster.  Results (keys and values unescaped) are palloc'd in the
 * current memory context.
 */
bool
outbox_parse_kafka_properties(const char *text, OutboxKafkaProperty **props,
							  int *nprops, char **error)
{
	return outbox_parse_properties(text, reserved_kafka_properties, "the relay",
								   props, nprops, error);
}

/*
 * outbox_parse_properties
 *		outbox_parse_kafka_properties with another list of reserved keys
 *		(NULL-terminated), set by who ("the relay", "the inbox").  The
 *		forbidden keys are the same for every setting.
 */
bool
outbox_parse_properties(const char *text, const char *const *reserved,
						const char *who, OutboxKafkaProperty **props,
						int *nprops, char **error)
{
	char	   *cursor = pstrdup(text ? text : "");
	int			n = 0;
	int			position = 0;
	int			cap = 8;
	OutboxKafkaProperty *out = palloc(sizeof(OutboxKafkaProperty) * cap);

	while (cursor != NULL)
	{
		char	   *item = outbox_trim_whitespace(next_item(&cursor));
		char	   *eq;
		char	   *key;
		char	   *value;

		position++;
		if (*item == '\0' && cursor == NULL)
			break;				/* the whole value is empty, or ends in ';' */
		/* messages never quote an item or a value: they may be secrets */
		if (*item == '\0')
		{
			*error = psprintf("item %d is empty (write a ';' inside a value as \\;)", position);
			return false;
		}
		eq = strchr(item, '=');
		if (eq == NULL)
		{
			*error = psprintf("item %d is not of the form key=value (write a ';' inside a value as \\;)", position);
			return false;
		}
		*eq = '\0';
		key = outbox_trim_whitespace(item);
		value = outbox_trim_whitespace(eq + 1);
		unescape(key);
		unescape(value);
		if (*key == '\0')
		{
			*error = psprintf("item %d has an empty key", position);
			return false;
		}
		if (!key_allowed(key, reserved, who, error))
			return false;
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

/*
 * Defaults the relay sets before the user's outbox.kafka_properties.  acks
 * and idempotence are fixed (reserved_kafka_properties refuses to override
 * them); the rest are tuned for a relay that sends batches and waits for
 * their reports.
 */
static const char *const default_properties[][2] = {
	{"enable.idempotence", "true"},
	{"acks", "all"},
	/* same key -> partition mapping as the Java client and Debezium */
	{"partitioner", "murmur2_random"},
	/* a claimed batch is produced at once; do not wait to fill batches */
	{"linger.ms", "1"},
	/* the broker's default message.max.bytes (1 MiB + 12), not 1 MB */
	{"message.max.bytes", "1048588"},

	/*
	 * When the broker refuses a message for good (too large for the topic,
	 * say), the idempotent producer would go on with the partition's later
	 * messages, so a later event of the same aggregate could overtake the
	 * refused one.  With this, librdkafka stops instead (a fatal error):
	 * the relay records the refusal, rebuilds the producer, and the held
	 * back events wait behind the refused one.  (A later batch may already
	 * be on the wire when it stops, so the relay also keeps a large event's
	 * successors out of its batch: see BARRIER_BYTES in message.c.)
	 */
	{"enable.gapless.guarantee", "true"},

	/* bound the memory librdkafka may queue (default would be 1 GB) */
	{"queue.buffering.max.kbytes", "65536"},
	{"client.id", "outbox-relay"},
	/* reports, errors and logs reach us only through rd_kafka_poll() */
	{"log.queue", "true"},
	{"socket.keepalive.enable", "true"},
	/* small produce requests go out at once, not after the peer's ACK */
	{"socket.nagle.disable", "true"},

	/*
	 * never run sasl.kerberos.kinit.cmd (a shell command): see
	 * reserved_kafka_properties
	 */
	{"sasl.kerberos.min.time.before.relogin", "0"},
	{NULL, NULL}
};

/*
 * outbox_kafka_conf_new
 *		The librdkafka configuration of the relay's producer, from
 *		bootstrap_servers ("host:port,..."), delivery_timeout_ms (ms, as
 *		message.timeout.ms), the relay's defaults (default_properties) and
 *		properties, the text of outbox.kafka_properties ("key=value;...").
 *
 * Returns NULL with *error set (palloc'd, free of property values, which may
 * be secrets) when properties is malformed or names a reserved or forbidden
 * key, or librdkafka refuses a property (unknown, or an invalid value).  The
 * caller owns the configuration: rd_kafka_new() takes it over, or
 * rd_kafka_conf_destroy() frees it.  Never call this in the postmaster.
 */
rd_kafka_conf_t *
outbox_kafka_conf_new(const char *bootstrap_servers, int delivery_timeout_ms,
					  const char *properties, char **error)
{
	rd_kafka_conf_t *conf;
	OutboxKafkaProperty *props;
	int			nprops;
	int			i;

	if (!outbox_parse_kafka_properties(properties, &props, &nprops, error))
	{
		*error = psprintf("outbox.kafka_properties: %s", *error);
		return NULL;
	}

	conf = rd_kafka_conf_new();
	if (!set_relay_properties(conf, bootstrap_servers, delivery_timeout_ms,
							  error))
	{
		rd_kafka_conf_destroy(conf);
		return NULL;
	}
	for (i = 0; i < nprops; i++)
	{
		if (!set_property(conf, props[i].key, props[i].value, error))
		{
			*error = psprintf("outbox.kafka_properties: %s", *error);
			rd_kafka_conf_destroy(conf);
			return NULL;
		}
	}
	return conf;
}

/*
 * Set what the relay sets itself: the servers, the delivery timeout (ms),
 * the topic metadata wait derived from it, and default_properties.  False
 * with *error set when librdkafka refuses one.
 */
static bool
set_relay_properties(rd_kafka_conf_t *conf, const char *bootstrap_servers,
					 int delivery_timeout_ms, char **error)
{
	char		timeout[32];
	char		propagation[32];
	int			i;

	snprintf(timeout, sizeof(timeout), "%d", delivery_timeout_ms);

	/*
	 * A topic that does not appear must be reported as unknown (permanent)
	 * before its messages time out (transient), so wait at most half the
	 * delivery timeout for it to show up.
	 */
	snprintf(propagation, sizeof(propagation), "%d",
			 Min(30000, delivery_timeout_ms / 2));
	if (!set_property(conf, "bootstrap.servers", bootstrap_servers, error) ||
		!set_property(conf, "message.timeout.ms", timeout, error) ||
		!set_property(conf, "topic.metadata.propagation.max.ms", propagation, error))
		return false;
	for (i = 0; default_properties[i][0] != NULL; i++)
	{
		if (!set_property(conf, default_properties[i][0],
						  default_properties[i][1], error))
			return false;
	}
	return true;
}

/*
 * Set one property of conf.  False with *error set (palloc'd) when
 * librdkafka does not know key or refuses value; the message shows the value
 * only when key is not secret.
 */
static bool
set_property(rd_kafka_conf_t *conf, const char *key, const char *value,
			 char **error)
{
	char		errstr[512];
	rd_kafka_conf_res_t res;

	res = rd_kafka_conf_set(conf, key, value, errstr, sizeof(errstr));
	if (res == RD_KAFKA_CONF_OK)
		return true;
	if (res == RD_KAFKA_CONF_UNKNOWN)
		*error = psprintf("unknown librdkafka property \"%s\"", key);
	else if (outbox_kafka_property_is_secret(key))
		*error = psprintf("invalid value for librdkafka property \"%s\"", key);
	else
		*error = psprintf("invalid value for librdkafka property \"%s\": %s",
						  key, errstr);
	return false;
}

/*-------------------------------------------------------------------------
 *
 * topic.c
 *	  Kafka's rules for topic names, and the allowed-topics list.
 *
 * A topic name is Kafka's to judge (org.apache.kafka.common.internals.Topic):
 * 1 to OUTBOX_TOPIC_MAX_LEN (249) characters of [a-zA-Z0-9._-], and neither
 * "." nor "..".  outbox checks it where a name is made, so that a bad one
 * fails early with a message that says why:
 *	- outbox.topic_prefix and the entries of outbox.allowed_topics when they
 *	  are set (guc.c),
 *	- the topic of every event when it is emitted (emit.c),
 *	- a routed topic again when the relay produces it, because the prefix may
 *	  have changed since the event was emitted (message.c).
 *
 * Nothing here reads a setting or raises an error: callers pass the values
 * and word the messages.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/topic.h"

/*
 * True if c may appear in a topic name.  Written out instead of isalnum(),
 * whose answer may depend on the locale.
 */
static inline bool
topic_char_is_legal(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		(c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}

/*
 * outbox_topic_chars_are_legal
 *		True if each of the len bytes at s is a character Kafka allows in
 *		topic names: an ASCII letter or digit, '.', '_' or '-'.  Says nothing
 *		about the length.
 */
bool
outbox_topic_chars_are_legal(const char *s, size_t len)
{
	size_t		i;

	for (i = 0; i < len; i++)
	{
		if (!topic_char_is_legal(s[i]))
			return false;
	}
	return true;
}

/*
 * outbox_topic_is_legal
 *		True if the len bytes at topic form a topic name Kafka accepts:
 *		1 to 249 characters of [a-zA-Z0-9._-], and not "." or "..".
 */
bool
outbox_topic_is_legal(const char *topic, size_t len)
{
	if (len < 1 || len > OUTBOX_TOPIC_MAX_LEN)
		return false;
	if ((len == 1 && topic[0] == '.') ||
		(len == 2 && topic[0] == '.' && topic[1] == '.'))
		return false;
	return outbox_topic_chars_are_legal(topic, len);
}

/*
 * outbox_topic_prefix_is_legal
 *		True if the len bytes at prefix can begin a legal topic name and
 *		leave room for at least one more character: legal characters only,
 *		at most 248 of them.  The empty prefix is legal.
 *
 * This is the rule of outbox.topic_prefix (a routed topic is prefix ||
 * aggregate_type) and of an outbox.allowed_topics entry "prefix*".
 */
bool
outbox_topic_prefix_is_legal(const char *prefix, size_t len)
{
	return len < OUTBOX_TOPIC_MAX_LEN &&
		outbox_topic_chars_are_legal(prefix, len);
}

/*
 * outbox_topic_is_internal
 *		True if topic is one of Kafka's internal topics.  A producer cannot
 *		write to them, so an event for one could only ever become a dead
 *		letter.
 */
bool
outbox_topic_is_internal(const char *topic)
{
	static const char *const internal[] = {
		"__consumer_offsets", "__transaction_state", "__share_group_state",
		"__cluster_metadata", NULL
	};
	int			i;

	for (i = 0; internal[i] != NULL; i++)
		if (strcmp(topic, internal[i]) == 0)
			return true;
	return false;
}

/*
 * outbox_routed_topic
 *		The topic of an event emitted without one: prefix || aggregate_type
 *		(prefix is outbox.topic_prefix), palloc'd in the current memory
 *		context.  Not checked: see outbox_topic_is_legal().
 */
char *
outbox_routed_topic(const char *prefix, const char *aggregate_type)
{
	return psprintf("%s%s", prefix, aggregate_type);
}

/*
 * outbox_topic_pattern_is_legal
 *		True if pattern may be an entry of outbox.allowed_topics: a legal
 *		topic name, or a legal prefix (see outbox_topic_prefix_is_legal)
 *		followed by '*'.  "*" alone allows every topic.
 */
bool
outbox_topic_pattern_is_legal(const char *pattern)
{
	size_t		len = strlen(pattern);

	if (len > 0 && pattern[len - 1] == '*')
		return outbox_topic_prefix_is_legal(pattern, len - 1);
	return outbox_topic_is_legal(pattern, len);
}

/*
 * outbox_topic_list_pack
 *		Check the entries of outbox.allowed_topics (a List of C strings) and
 *		copy them into buf as the packed list outbox_topic_list_allows()
 *		reads: each entry followed by '\0', the whole followed by one more
 *		'\0'.  An empty List packs to "" (every topic allowed).
 *
 * buf must hold the entries, a terminator each, and one byte more: when
 * they were split out of a comma-separated value, strlen(value) + 2 bytes
 * always suffice.  Returns NULL, or the first entry that is not
 * outbox_topic_pattern_is_legal(); buf is then left incomplete.
 */
const char *
outbox_topic_list_pack(const List *patterns, char *buf)
{
	ListCell   *lc;
	char	   *out = buf;

	foreach(lc, patterns)
	{
		const char *pattern = (const char *) lfirst(lc);
		size_t		n = strlen(pattern);

		if (!outbox_topic_pattern_is_legal(pattern))
			return pattern;
		memcpy(out, pattern, n + 1);
		out += n + 1;
	}
	*out = '\0';
	return NULL;
}

/*
 * outbox_topic_list_allows
 *		True if list (packed by outbox_topic_list_pack(), or NULL) is empty,
 *		names topic, or has an entry "prefix*" that topic starts with.
 */
bool
outbox_topic_list_allows(const char *list, const char *topic)
{
	const char *entry;

	if (list == NULL || list[0] == '\0')
		return true;
	for (entry = list; *entry; entry += strlen(entry) + 1)
	{
		size_t		n = strlen(entry);

		if (entry[n - 1] == '*' ? strncmp(topic, entry, n - 1) == 0
			: strcmp(topic, entry) == 0)
			return true;
	}
	return false;
}

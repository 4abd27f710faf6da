/*-------------------------------------------------------------------------
 *
 * cloudevents.c
 *	  What a CloudEvents consumer can read: the rules for outbox.ce_source
 *	  and for the ce_* headers an event brings itself.
 *
 * With outbox.message_format = cloudevents an event's ce_* headers become
 * its CloudEvents attributes (row_message.c).  A value a CloudEvents SDK
 * refuses (io.cloudevents' CloudEventDeserializer: java.net.URI for
 * source, OffsetDateTime for time, [a-z0-9] extension names) would make
 * the event unreadable at every consumer, long after the transaction that
 * wrote it committed.  So they are checked where they are written: emit()
 * refuses such a header (22023), and outbox.ce_source refuses such a value.
 * The rules apply in either message format, since the format may change
 * while events wait.
 *
 * Source of truth: CloudEvents 1.0.2 (spec.md, "Context Attributes";
 * bindings/kafka-protocol-binding.md), RFC 3986 (URI reference) and
 * RFC 3339 (time).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/cloudevents.h"

#include <ctype.h>

static bool is_rfc3339(const char *s, size_t len);
static bool digits(const char *s, int n, int min, int max, int *value);

/*
 * outbox_uri_reference_is_valid
 *		Is s (len bytes) a non-empty URI reference (RFC 3986) that
 *		java.net.URI accepts too: unreserved and reserved characters and
 *		%XX escapes only (no brackets: no IPv6 literal), at most one '#', a
 *		':' in the first segment only after a scheme (a letter, then
 *		letters, digits, '+', '-', '.') with something after it.  Raises no
 *		error.
 */
bool
outbox_uri_reference_is_valid(const char *s, size_t len)
{
	size_t		first_segment = 0;
	const char *colon;
	const char *p;
	int			fragments = 0;
	size_t		i;

	if (len == 0)
		return false;
	for (i = 0; i < len; i++)
	{
		unsigned char c = (unsigned char) s[i];

		if (c == '%')
		{
			if (i + 2 >= len || !isxdigit((unsigned char) s[i + 1]) ||
				!isxdigit((unsigned char) s[i + 2]))
				return false;
			i += 2;
		}
		else if (c == '#')
			fragments++;
		else if (!(c < 0x80 && (isalnum(c) || (c != '\0' && strchr("-._~:/?@!$&'()*+,;=", c)))))
			return false;
	}
	if (fragments > 1)
		return false;
	while (first_segment < len && strchr("/?#", s[first_segment]) == NULL)
		first_segment++;
	colon = memchr(s, ':', first_segment);
	if (colon == NULL)
		return true;
	if (colon == s || !isalpha((unsigned char) s[0]) || colon + 1 == s + len)
		return false;
	for (p = s; p < colon; p++)
		if (!isalnum((unsigned char) *p) && strchr("+-.", *p) == NULL)
			return false;
	return true;
}

/*
 * outbox_check_cloudevents_header
 *		Raise 22023 if the header key (a C string) with value (len bytes,
 *		not NUL-terminated) is a ce_* header a CloudEvents consumer could
 *		not read: ce_source or ce_dataschema not a URI reference, ce_type or
 *		ce_subject empty, ce_time not an RFC 3339 time, ce_datacontenttype
 *		at all (the Kafka binding's content type is the content-type
 *		header), or an extension name other than lower-case letters and
 *		digits.  Other keys pass.  (ce_id and ce_specversion are refused
 *		before, as reserved.)
 */
void
outbox_check_cloudevents_header(const char *key, const char *value, size_t len)
{
	const char *problem = NULL;
	const char *p;

	if (strncmp(key, "ce_", 3) != 0)
		return;
	if (strcmp(key, "ce_source") == 0 || strcmp(key, "ce_dataschema") == 0)
	{
		if (!outbox_uri_reference_is_valid(value, len))
			problem = "must be a URI reference: no spaces, quotes or characters outside ASCII (percent-encode them)";
	}
	else if (strcmp(key, "ce_type") == 0 || strcmp(key, "ce_subject") == 0)
	{
		if (len == 0)
			problem = "must not be empty";
	}
	else if (strcmp(key, "ce_time") == 0)
	{
		if (!is_rfc3339(value, len))
			problem = "must be an RFC 3339 time, e.g. 2026-12-03T04:05:06.123456Z";
	}
	else if (strcmp(key, "ce_datacontenttype") == 0)
		problem = "is not a header in the Kafka binding: set the header \"content-type\"";
	else
	{
		for (p = key + 3; *p != '\0'; p++)
			if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9')))
				break;
		if (p == key + 3 || *p != '\0')
			problem = "names a CloudEvents extension attribute, whose name must be lower-case letters and digits";
	}
	if (problem != NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers key \"%s\" %s", key, problem),
				 errdetail("Headers starting with ce_ are CloudEvents attributes (outbox.message_format = cloudevents); a consumer could not read the event."),
				 errhint("Fix the value, or use a header name without the ce_ prefix.")));
}

/*
 * YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM), a real date, 'T' and
 * 'Z' in either case, 1 to 9 fraction digits (what OffsetDateTime parses).
 */
static bool
is_rfc3339(const char *s, size_t len)
{
	static const int month_days[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
	int			year,
				month,
				day,
				unused;
	size_t		i = 19;

	if (len < 20 ||
		!digits(s, 4, 0, 9999, &year) || s[4] != '-' ||
		!digits(s + 5, 2, 1, 12, &month) || s[7] != '-' ||
		!digits(s + 8, 2, 1, month_days[month - 1], &day) ||
		(s[10] != 'T' && s[10] != 't') ||
		!digits(s + 11, 2, 0, 23, &unused) || s[13] != ':' ||
		!digits(s + 14, 2, 0, 59, &unused) || s[16] != ':' ||
		!digits(s + 17, 2, 0, 59, &unused))
		return false;
	if (month == 2 && day == 29 &&
		!(year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)))
		return false;
	if (s[i] == '.')
	{
		size_t		start = ++i;

		while (i < len && isdigit((unsigned char) s[i]))
			i++;
		if (i == start || i - start > 9)
			return false;
	}
	if (i + 1 == len && (s[i] == 'Z' || s[i] == 'z'))
		return true;
	return i + 6 == len && (s[i] == '+' || s[i] == '-') &&
		digits(s + i + 1, 2, 0, 23, &unused) && s[i + 3] == ':' &&
		digits(s + i + 4, 2, 0, 59, &unused);
}

/* are the n bytes at s decimal digits of a number from min to max? */
static bool
digits(const char *s, int n, int min, int max, int *value)
{
	int			v = 0;
	int			i;

	for (i = 0; i < n; i++)
	{
		if (!isdigit((unsigned char) s[i]))
			return false;
		v = v * 10 + (s[i] - '0');
	}
	*value = v;
	return v >= min && v <= max;
}

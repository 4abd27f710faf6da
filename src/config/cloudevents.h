/*-------------------------------------------------------------------------
 *
 * cloudevents.h
 *	  What a CloudEvents consumer can read (cloudevents.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_CLOUDEVENTS_H
#define OUTBOX_CLOUDEVENTS_H

extern bool outbox_uri_reference_is_valid(const char *s, size_t len);
extern void outbox_check_cloudevents_header(const char *key, const char *value,
											size_t len);

#endif							/* OUTBOX_CLOUDEVENTS_H */

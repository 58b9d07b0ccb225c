/* SPDX-License-Identifier: MIT */
/*
 * metrics_check.c: checks a metrics file of fsdp-train --metrics for the shell tests
 * (t_fsdp_train.sh) and prints what it holds.
 *
 *   metrics_check FILE
 *
 * Every line must be a JSON object with a string "type" and a finite number "time" (seconds
 * since the epoch, after 2020 and never decreasing), and the first must be the "config" record
 * with "version", "build", "world", "backend", "device", "model" and "flags". Prints
 *   records N
 *   type TYPE N          for each type, in order of first appearance
 *   flag NAME            for every key of the config record's flags
 * Exit status 0 when the file passes, 1 with the line and the reason on stderr otherwise, 2 for
 * a bad command line.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#define MAX_TYPES 16

static int fail(long line, const char *why) {
    fprintf(stderr, "metrics_check: line %ld: %s\n", line, why);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: metrics_check FILE\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "r");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    char buf[1 << 16];
    const char *types[MAX_TYPES];
    long counts[MAX_TYPES] = {0};
    char names[MAX_TYPES][32];
    int ntypes = 0;
    long line = 0;
    double last = 0;
    int rc = 0;
    while (rc == 0 && fgets(buf, sizeof buf, f)) {
        line++;
        json_error_t e;
        json_t *rec = json_loads(buf, 0, &e);
        json_t *type = rec ? json_object_get(rec, "type") : NULL;
        json_t *time = rec ? json_object_get(rec, "time") : NULL;
        if (!rec || !json_is_object(rec)) {
            rc = fail(line, rec ? "not an object" : e.text);
        } else if (!json_is_string(type)) {
            rc = fail(line, "no string \"type\"");
        } else if (!json_is_number(time) || !isfinite(json_number_value(time)) ||
                   json_number_value(time) < 1.58e9 || json_number_value(time) < last) {
            rc = fail(line, "\"time\" is missing, not after 2020 or goes back");
        } else if (line == 1) {
            static const char *const need[] = {"version", "build", "world", "backend",
                                               "device",  "model", "flags"};
            if (strcmp(json_string_value(type), "config") != 0) rc = fail(1, "not the config");
            for (size_t i = 0; rc == 0 && i < sizeof need / sizeof *need; i++)
                if (!json_object_get(rec, need[i])) rc = fail(1, need[i]);
            const char *key;
            json_t *v;
            json_object_foreach(json_object_get(rec, "flags"), key, v) printf("flag %s\n", key);
        }
        if (rc == 0) {
            last = json_number_value(time);
            const char *t = json_string_value(type);
            int i = 0;
            while (i < ntypes && strcmp(names[i], t) != 0)
                i++;
            if (i == ntypes && ntypes < MAX_TYPES) {
                snprintf(names[ntypes], sizeof names[ntypes], "%s", t);
                types[ntypes] = names[ntypes];
                ntypes++;
            }
            if (i < ntypes) counts[i]++;
        }
        json_decref(rec);
    }
    fclose(f);
    if (rc != 0) return rc;
    if (line == 0) return fail(0, "empty file");
    printf("records %ld\n", line);
    for (int i = 0; i < ntypes; i++)
        printf("type %s %ld\n", types[i], counts[i]);
    return 0;
}
